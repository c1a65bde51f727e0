"""Every issue-#40 job as one resumable list, the cheapest answers first: the SmolLM2-MLA testbed's
study and the tiny-mla-v2 records its claims table sets beside it.

Each job is a `quantmla.run` sweep that skips the cells that already have records, and calibrated
methods load their committed artifacts, so running the campaign again continues where it stopped.
Costs are measured on 2 CPU cores alone (`python -m analysis.tables smol_costs` has every job's).

    python -m experiments.smol_campaign             # every job, in order
    python -m experiments.smol_campaign --list      # the jobs, what each gives and costs
    python -m experiments.smol_campaign --from 5    # from job 5 on
    python -m experiments.smol_campaign --only 3    # job 3 alone
    python -m experiments.smol_campaign --only 7,8,22 --commit   # these, in this order, each job's
                                                    # records committed as it ends (a machine that may stop)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Job(NamedTuple):
    name: str
    gives: str
    cost: str  # on 2 CPU cores, alone
    overrides: tuple[str, ...]


FEWSHOT = ("experiment=smol_table1", "eval=commonsense_fewshot", "eval.limit=100")
SUITE = ("experiment=smol_table1", "eval=table1_suite")
GRID = ("precision=bf16,c4r4,c2r4", "method=quantmla,rtn,quarot,smoothquant")
# smol_frontier's candidates less the 1-bit latents: job 3's sixteen best allocations under the
# R × NMSE predictor all took some, and all lost to uniform C2R4 (docs/frontier.md)
NO_1BIT = (
    "precision.candidates=[c2r2,c2r3,c2r4,c3r3,c3r4,c4r3,c4r4,c4r8,c8r8,cnvfp4re4m3t,"
    "cmxfp4rmxfp4,clm4r16,ce4m3r16,bf16]"
)
JOBS = (
    Job("path split", "why SmoothQuant† is ahead of QuaRot† (claims table)", "~1 h: 6 cells",
        ("experiment=smol_table1", "experiment_name=smol_path_split", "precision=c2r16,c16r4",
         "method=rtn,quarot,smoothquant")),
    Job("mixed RTN at 120 B", "a per-layer allocation vs uniform C2R4 at its bytes (RTN)", "55 min",
        ("experiment=smol_frontier", "precision=mixed", "precision.budget_bytes=120")),
    # the linear predictor's allocation lost to uniform C2R4 (docs/frontier.md): the 16 best
    # allocations measured whole before one is taken
    Job("mixed RTN at 120 B, joint check", "the same budget with the whole-model check of 16",
        "~25 min: the check (the candidates' errors are job 2's, kept)",
        ("experiment=smol_frontier", "precision=mixed", "precision.budget_bytes=120",
         "precision.joint_top=16")),
    # the claims table's tiny-mla-v2 column (its records predate committed records): cheap
    Job("tiny-mla-v2 Table 1", "the tiny column's accuracy claims", "~25 min",
        ("experiment=tiny_table1_v2",)),
    Job("tiny-mla-v2 sensitivity", "the tiny column's RoPE-sensitivity claim", "not measured",
        ("experiment=tiny_fig2_sensitivity",)),
    Job("tiny-mla-v2 probes", "the tiny column's operator claim", "2-3 min a cell",
        ("experiment=tiny_table5_probes",)),
    Job("tiny-mla-v2 RULER", "the tiny column's retrieval claim: BF16, RTN",
        "~7 min a cell (11-14 CPU-minutes)",
        ("experiment=tiny_fig4_ruler_v2",)),
    Job("tiny-mla-v2 RULER QuantMLA", "... and QuantMLA C4R4", "~30 min fit + 7 min",
        ("experiment=tiny_fig4_ruler_v2", "precision=c4r4", "method=quantmla")),
    Job("few-shot baselines", "Table 1 twin's few-shot columns: BF16, RTN, QuaRot†, SmoothQuant† C2R4",
        "19-30 min a cell", (*FEWSHOT, "precision=bf16,c2r4", "method=rtn,quarot,smoothquant")),
    Job("C4R4 baselines", "Table 1 twin's C4R4 rows", "7-22 min a cell",
        ("experiment=smol_table1", "precision=c4r4", "method=rtn,quarot,smoothquant")),
    # the suite's columns for every row of the twin: QuantMLA first, BF16 once (method=rtn)
    Job("0-shot", "the five tasks 0-shot, every row (few of their prompts pass the 132 protected "
        "tokens)", "not measured",
        (*SUITE, "eval.tasks=[hellaswag,piqa,arc_easy,arc_challenge,winogrande]", "eval.limit=100",
         *GRID)),
    Job("MMLU 5-shot", "MMLU column, 2 documents of each of the 57 subjects, every row",
        "~10 min a cell", (*SUITE, "eval.tasks=[mmlu]", "eval.limit=2", *GRID)),
    # generation decodes up to 256 tokens a document; batches of 25 cost about what batches of 4
    # do a step (SmolLM2-MLA C4R4 at 1,000 tokens: 0.52 s a step at 20, 0.30 at 4)
    Job("GSM8K 5-shot", "GSM8K column, every row, 50 documents (near zero at 135M: reported anyway)",
        "8.4-13.2 min a cell alone (2 batches of 25)",
        (*SUITE, "eval.tasks=[gsm8k]", "eval.limit=50", "eval.batch_size=25", *GRID)),
    Job("few-shot QuantMLA C2R4", "QuantMLA's few-shot row (fits C2R4 unless its artifact exists)",
        "~1 h fit + 30 min", (*FEWSHOT, "precision=c2r4", "method=quantmla")),
    Job("QuantMLA C4R4", "Table 1 twin's C4R4 QuantMLA row (C4R4 parity claim)", "57 min: 53 of it calibration",
        ("experiment=smol_table1", "precision=c4r4", "method=quantmla")),
    Job("mixed QuantMLA at 120 B", "the issue-#23 target: mixed vs uniform QuantMLA C2R4 at 120 B, "
        "no 1-bit latents, the output error model (job 32 first: the same allocation under RTN, "
        "at parity with uniform RTN C2R4)",
        "54 min beside other jobs: the joint check 33, its 18 RoPE units no earlier fit held 16 "
        "(C2R4's INT2 latents and job 21's MXFP4 units reused); job 2's errors", ("experiment=smol_frontier", "method=quantmla", "precision=mixed",
                       "precision.budget_bytes=120", "precision.allocation_method=rtn", NO_1BIT,
                       "precision.allocation_error=output", "precision.joint_top=16",
                       "method.calibration.seqlen=512")),
    Job("mixed RTN at the peers' bytes", "mixed allocations at C3R4's, MXFP4's, C4R4's, NVFP4's and "
        "the Lloyd-Max cache's bytes, each beside that format (job 32's allocator: the output "
        "error model, no 1-bit latents)", "~20 min a budget (job 2's errors)",
        ("experiment=smol_frontier", "precision=mixed", "precision.budget_bytes=152,170,184,208,258",
         NO_1BIT, "precision.allocation_error=output", "precision.joint_top=16")),
    Job("probes", "Tables 5 / 6, Fig. 7 on SmolLM2-MLA with γ transferred",
        "14 min a SmolLM2-MLA cell (30 layers), 1-2 min a tiny-mla-v2 cell: ~1.6 h",
        ("experiment=smol_table5_probes",)),
    Job("full sets", "Table 1 twin's perplexity on the full sets at 2,048 and 4,096",
        "~15 min a cell at 2,048 (221 windows; a C2R4 window ~3.4 s alone); at 4,096 (110 windows) "
        "70-74 min a cell with one thread beside another (69-72 CPU-minutes)",
        ("experiment=smol_table1_full",)),
    Job("few-shot C4R4", "Table 1 twin's few-shot columns at C4R4 (QuantMLA's first: the "
        "accuracy-parity claim)", "~30 min a cell",
        (*FEWSHOT, "precision=c4r4", "method=quantmla,rtn,quarot,smoothquant")),
    Job("frontier peers with QuantMLA", "the engines' 4-bit formats with QuantMLA's transforms",
        "~1 h fit a format (as job 15)", ("experiment=smol_frontier", "method=quantmla",
                                "precision=c2r4,cnvfp4re4m3t,cmxfp4rmxfp4,clm4r16",
                                "method.calibration.seqlen=512")),
    # vLLM on 2 cores: 240 requests of 1K-8K, 16 a call (23 s at 1K, ~10 min at 8K); far slower
    # beside another job (its threads are bound to the cores)
    Job("RULER", "Fig. 4 twin through vLLM: BF16, QuantMLA and RTN C4R4 (make serve-setup first)",
        "~1 h a cell alone (QuantMLA C4R4: 57 min, 111 CPU-minutes)", ("experiment=smol_fig4_ruler",)),
    # appended (a running queue keeps the numbers above): the claims table's remaining cells
    Job("tiny-mla-v2 path split", "the tiny column's ranking: each path of the baselines alone",
        "3 min", ("experiment=tiny_table1_v2", "experiment_name=tiny_path_split",
                  "eval=perplexity", "precision=c2r16,c16r4", "method=rtn,quarot,smoothquant")),
    Job("tiny-mla-v2 few-shot BF16", "whether the tiny testbed answers the accuracy claims at all "
        "(their BF16 against chance)", "2 min: BF16 33.8, at chance",
        ("experiment=tiny_table1_v2", "eval=commonsense_fewshot", "eval.limit=100", "precision=bf16",
         "method=rtn")),
    Job("cache-pressure throughput", "the throughput claim on SmolLM2-MLA: BF16 mode vs C4R4 at the "
        "tiny twin's tightest budget, scaled (make serve-setup first)", "34 min",
        ("experiment=smol_fig5c_throughput",)),
    # records before 2026-12-04 kept no per-document scores; force=true recomputes the records
    # (the artifacts load; a rerun recomputes every cell again) and says whether lm-eval's scores
    # reproduce (git diff of the records)
    Job("few-shot per-document scores", "the C2R4 cells again with each document's score: the "
        "accuracy claims compared paired", "26 min a cell",
        (*FEWSHOT, "precision=bf16,c2r4", "method=rtn,quantmla,quarot,smoothquant", "force=true")),
    Job("FP8 formats with QuantMLA", "the engines' FP8 caches (vLLM fp8, fp8_ds_mla) with "
        "QuantMLA's transforms, beside job 21's 4-bit ones", "~1 h fit a format (as job 15)",
        ("experiment=smol_frontier", "method=quantmla", "precision=ce4m3tre4m3t,ce4m3r16",
         "method.calibration.seqlen=512")),
    # QuantMLA's transforms are separable per layer and path (quantmla/methods/reuse.py): each
    # path alone is assembled from the C2R4 / C4R4 fits' units, nothing fitted
    Job("path split QuantMLA", "QuantMLA's rows of the path split: its learned per-pair RoPE "
        "transforms against QuaRot†'s online Hadamard, its content transforms alone",
        "2-3 min a cell: nothing fitted", ("experiment=smol_table1", "experiment_name=smol_path_split",
                                          "precision=c2r16,c16r4", "method=quantmla")),
    Job("tiny-mla-v2 path split QuantMLA", "the same on the tiny testbed", "~15 s a cell",
        ("experiment=tiny_table1_v2", "experiment_name=tiny_path_split", "eval=perplexity",
         "precision=c2r16,c16r4", "method=quantmla")),
    # the RoPE path fitted to the attention output (docs/method.md §4): C16R4 fits its RoPE units,
    # C4R4 and C2R4 then take them and the default fits' content units (nothing fitted)
    Job("RoPE fitted to the output", "whether QuantMLA's RoPE path closes its gap to QuaRot†'s "
        "Hadamard when fitted to the attention output instead of the QK scores",
        "~25 min: one RoPE fit, then 2 min a cell",
        ("experiment=smol_table1", "experiment_name=smol_rope_objective", "method=quantmla",
         "precision=c16r4,c4r4,c2r4", "method.calibration.rope_objective=output")),
    Job("mixed RTN at 120 B, no 1-bit latents", "whether a mixed RTN cache beats uniform C2R4 at its "
        "bytes when no layer may take a 1-bit latent (job 3's sixteen all took some and lost)",
        "~15 min: the check (job 2's errors, a subset of its candidates)",
        ("experiment=smol_frontier", "precision=mixed", "precision.budget_bytes=120", NO_1BIT,
         "precision.joint_top=16")),
    Job("mixed RTN at 120 B, output model", "job 31 with each layer's measured output NMSE as the "
        "error model instead of R × cache NMSE (job 31's sixteen moved RoPE keys to 3 bits and lost)",
        "~17 min: the check (job 2's errors)",
        ("experiment=smol_frontier", "precision=mixed", "precision.budget_bytes=120", NO_1BIT,
         "precision.allocation_error=output", "precision.joint_top=16")),
    # QuantMLA's fitted RoPE angles lose their edge on keys past the 512 calibration positions
    # (docs/results.md): the RoPE path fitted at the paper's 2,048 (32 + 8 sequences: the same
    # tokens and memory as 128 + 32 of 512)
    Job("RoPE fitted at 2,048", "whether QuantMLA's RoPE path closes its gap to QuaRot†'s Hadamard "
        "when calibrated at the evaluation's length", "not measured: one RoPE fit, then 2 min",
        ("experiment=smol_table1", "experiment_name=smol_rope_seqlen", "method=quantmla",
         "precision=c16r4", "method.calibration.seqlen=2048", "method.calibration.n_calibration=32",
         "method.calibration.n_heldout=8")),
    Job("RoPE error by key position", "each method's RoPE-key QK error on keys inside and past the "
        "512 calibration positions (C16R4; QuantMLA's and SmoothQuant†'s units are smol_table1's)",
        "~2 min a cell: nothing fitted", ("experiment=smol_rope_positions",)),
    Job("RoPE error by key position, fit at 2,048", "... and job 33's RoPE fit at 2,048",
        "~2 min: job 33's units", ("experiment=smol_rope_positions", "method=quantmla",
                                  "method.calibration.seqlen=2048",
                                  "method.calibration.n_calibration=32",
                                  "method.calibration.n_heldout=8")),
    # the RoPE fit's positions moved instead (method.calibration.rope_positions, docs/method.md §4):
    # C16R4 fits the 30 RoPE units on 512-token sequences, C4R4 and C2R4 then take them
    Job("RoPE fitted on moved positions", "whether QuantMLA's RoPE path closes its gap to QuaRot† "
        "when its 512-token sequences meet the phases of positions 0-2,047",
        "not measured: one RoPE fit (~25 min), then 2 min a cell",
        ("experiment=smol_table1", "experiment_name=smol_rope_moved", "method=quantmla",
         "precision=c16r4,c4r4,c2r4", "method.calibration.rope_positions=2048")),
    Job("RoPE error by key position, moved fit", "... and job 36's RoPE fit", "~2 min: job 36's units",
        ("experiment=smol_rope_positions", "method=quantmla", "method.calibration.rope_positions=2048")),
    # QuantMLA C4R4 loses 10 paired points of S-NIAH-3 (job 22), whose needles sit at positions up
    # to 8K; its RoPE angles were fitted on positions 0-511 (docs/results.md)
    Job("RULER, RoPE fitted on moved positions", "whether QuantMLA's S-NIAH-3 loss at C4R4 comes "
        "from its RoPE fit's positions: the cell again with the RoPE units fitted on sequences "
        "moved across 0-8,191 (the content units are the C4R4 fit's)",
        "one RoPE fit (~12 min: capture 2, α search 2, 300 steps 7), then ~1 h",
        ("experiment=smol_fig4_ruler", "experiment_name=smol_fig4_ruler_moved", "precision=c4r4",
         "method=quantmla", "method.calibration.rope_positions=8192")),
    # job 38 did not recover S-NIAH-3: which path loses the UUID, measured per sample (each answer's
    # log-likelihood through the cache, paired against BF16; the same samples as job 22's)
    Job("RULER answers teacher-forced, per path", "where the S-NIAH-3 loss at C4R4 comes from: "
        "QuantMLA and RTN at C4R4, C4R16 (the latent alone) and C16R4 (the RoPE key alone), each "
        "sample's answer log-likelihood paired against BF16 (nothing fitted: smol_table1's units)",
        "~14.5 min a cell alone (BF16, C4R4: 872-876 s, ~28 CPU-minutes; 27 s an 8K sample; "
        "22-25 min, 43-45 CPU-minutes on a slower host)",
        ("experiment=smol_ruler_answer",)),
    # job 39: the INT4 RoPE key carries 87 % of QuantMLA C4R4's S-NIAH-3 loss and its RoPE
    # transforms recover 23 % of RTN's (docs/results.md); the production formats keep that key
    # wider (vLLM's fp8_ds_mla in BF16, nvfp4_ds_mla in FP8)
    Job("RULER answers, an INT8 RoPE key", "whether 32 B a token more (C4R8) recovers S-NIAH-3's "
        "answers, and the INT8 key alone (C16R8): QuantMLA (its INT8 RoPE units fitted, the "
        "content units the C4R4 fit's) and RTN, paired against job 39's BF16",
        "one INT8 RoPE fit (14 min: capture 3, α search 2, 300 steps 8), then ~22 min a cell "
        "(42 CPU-minutes; the slower host of 2026-12-05)",
        ("experiment=smol_ruler_answer", "precision.name=c4r8,c16r8")),
    # job 40: QuantMLA C4R8 keeps S-NIAH-3's answers teacher-forced (−0.15 ± 0.06 nats, copies as
    # BF16); the retrieval claim is read through vLLM's generation
    Job("RULER through vLLM, an INT8 RoPE key", "whether QuantMLA at C4R8 (the INT8 RoPE key, "
        "+32 B a token) retrieves S-NIAH-1/2/3 within 5 points of BF16 where C4R4 lost S-NIAH-3 "
        "(job 40's units: nothing fitted)", "~1.2 h on the slower host (its last 96 answers 45 min, "
        "88 CPU-minutes)", ("experiment=smol_fig4_ruler", "precision=c4r8", "method=quantmla")),
    Job("Frontier, an INT8 RoPE key", "QuantMLA C4R8's perplexity and bytes beside the frontier's "
        "formats (job 40's units)", "~3-15 min: nothing fitted",
        ("experiment=smol_frontier", "precision=c4r8", "method=quantmla",
         "method.calibration.seqlen=512")),
    Job("Frontier, an INT8 RoPE key, RTN", "RTN C4R8 beside job 42's QuantMLA", "~10-15 min",
        ("experiment=smol_frontier", "precision=c4r8")),
    # jobs 42/43: the INT8 RoPE key takes QuantMLA C4R4's loss away; the same key beside the INT2
    # latent is the frontier's point at C3R4's bytes (152 B at 256 + 64)
    Job("Frontier, C2R8", "QuantMLA C2R8 (an INT2 latent, an INT8 RoPE key: C3R4's 152 B) beside "
        "C3R4, the mixed allocations at 152 B and QuantMLA C2R4 (job 21's INT2 units, job 40's "
        "INT8 ones: nothing fitted)", "7 min: nothing fitted",
        ("experiment=smol_frontier", "precision=c2r8", "method=quantmla",
         "method.calibration.seqlen=512")),
    Job("Frontier, C2R8, RTN", "RTN C2R8 beside job 44's QuantMLA", "3 min",
        ("experiment=smol_frontier", "precision=c2r8")),
    # job 44: beside the INT2 latent the INT8 key costs nothing over the latent alone (C2R16); C3R8
    # has C4R4's bytes (184 B at 256 + 64; 288 against 320 at 512 + 64): a bit of the latent
    # moved to the RoPE key, the path that carries C4R4's loss here
    Job("Frontier, C3R8", "QuantMLA C3R8 at C4R4's bytes: the latent's fourth bit spent on the "
        "RoPE key (fits the INT3 content units; the INT8 RoPE units are job 40's)",
        "70 min: the INT3 content fit (capture 3, α search 2, 300 steps 61, partly shared), 5 min eval",
        ("experiment=smol_frontier", "precision=c3r8", "method=quantmla",
         "method.calibration.seqlen=512")),
    Job("Frontier, C3R8, RTN", "RTN C3R8 beside job 46's QuantMLA", "3 min",
        ("experiment=smol_frontier", "precision=c3r8")),
    Job("Mixed QuantMLA over the INT8 keys", "per-layer allocations over QuantMLA's C2R4, C2R8, C3R4, "
        "C3R8, C4R4 and C4R8 (every unit held after job 46) at C3R4's and C4R4's bytes, beside the "
        "uniform formats there (job 32's allocator: the output error model, the joint check)",
        "not measured: ~30 min a budget (the candidates' errors after the transforms, the check)",
        ("experiment=smol_frontier", "method=quantmla", "precision=mixed",
         "precision.budget_bytes=152,184", "precision.candidates=[c2r4,c2r8,c3r4,c3r8,c4r4,c4r8]",
         "precision.allocation_error=output", "precision.joint_top=16",
         "method.calibration.seqlen=512")),
    # job 21: on NVFP4 QuantMLA's transforms raise the output NMSE in 25 of 30 layers where on the
    # INT formats they lower it in all 30; which path does it, each alone
    # jobs 49/50 (first run): the latent carries the rise (NMSE 4.02e-3 against RTN's 3.40e-3), the
    # FP8 key none; cause: the content scales sat at u = c/Γ (Γ ≈ 1000), NVFP4's E4M3 block scales
    # subnormal there. Since e08bd5a they start at the latent's magnitude: the NVFP4 content units
    # are fitted again here (the FP8 key's are job 21's)
    Job("NVFP4 per path, QuantMLA", "which path raises QuantMLA's output error on nvfp4_ds_mla: its "
        "NVFP4 latent alone (BF16 key) and its FP8 key alone; the latent's units fitted at the "
        "latent's magnitude", "47 min: the NVFP4 content fit (capture 4, α search 2, 300 steps 37), "
        "then 3-7 min a cell",
        ("experiment=smol_frontier", "precision=cnvfp4r16,c16re4m3t", "method=quantmla",
         "method.calibration.seqlen=512")),
    Job("NVFP4 per path, RTN", "... and the same caches without transforms",
        "4-9 min a cell (beside other work)",
        ("experiment=smol_frontier", "precision=cnvfp4r16,c16re4m3t")),
    # job 46: QuantMLA C3R8 beats C4R4 at its bytes in perplexity; retrieval is where C4R4 lost
    Job("RULER through vLLM, C3R8", "whether QuantMLA C3R8 (C4R4's bytes: the latent's fourth bit "
        "on the RoPE key) retrieves S-NIAH-1/2/3 within 5 points of BF16 where C4R4 lost S-NIAH-3 "
        "(jobs 46 and 40's units: nothing fitted)", "not measured: ~1.2 h as job 41",
        ("experiment=smol_fig4_ruler", "precision=c3r8", "method=quantmla")),
    # issue #40 item 4 asks for every frontier format with and without QuantMLA's transforms; job
    # 21 covers C2R4, NVFP4, MXFP4 and Lloyd-Max, these the 8-bit ones (vLLM's fp8 became
    # meaningful with e08bd5a: its tensor scale 1.0 needs the latent's magnitude)
    Job("Frontier, 8-bit formats, QuantMLA", "QuantMLA on vLLM fp8 (E4M3 at tensor scale 1.0 on "
        "both paths), grouped E4M3 with a BF16 key (fp8_ds_mla's values) and C8R8",
        "a content fit each, the RoPE units held (job 21's E4M3, job 40's INT8): 74-130 min a cell "
        "beside one or two jobs (ce4m3r16: capture 6, α 4, 300 steps 63, selection 8; c8r8: 85 min)",
        ("experiment=smol_frontier", "precision=ce4m3tre4m3t,ce4m3r16,c8r8", "method=quantmla",
         "method.calibration.seqlen=512")),
    # since e08bd5a the baselines' content scales start at the latent's magnitude too, so their
    # cells on the engines' 4-bit and fixed-range formats mean what QuantMLA's beside them do
    Job("Frontier, engine formats, SmoothQuant†", "SmoothQuant† on vLLM fp8, nvfp4_ds_mla and "
        "MXFP4 beside RTN's and QuantMLA's cells (item 4's transforms other than QuantMLA's)",
        "9-11 min a cell (its α search ~2.5 min of it)",
        ("experiment=smol_frontier", "precision=cnvfp4re4m3t,cmxfp4rmxfp4,ce4m3tre4m3t",
         "method=smoothquant", "method.calibration.seqlen=512")),
    Job("Frontier, engine formats, QuaRot†", "... and QuaRot† (nothing fitted)",
        "10-14 min a cell (beside the CI run)",
        ("experiment=smol_frontier", "precision=cnvfp4re4m3t,cmxfp4rmxfp4,ce4m3tre4m3t",
         "method=quarot")),
    # job 54: on MXFP4 QuaRot† is ahead of QuantMLA on C4 (+0.62 % against +1.17 %, paired
    # 0.54 ± 0.17), level on WikiText-2; on the INT formats its edge was the RoPE path's (job 28)
    Job("MXFP4 per path, QuantMLA", "which path puts QuaRot† ahead of QuantMLA on MXFP4's C4: "
        "QuantMLA's MXFP4 latent alone (BF16 key) and its MXFP4 RoPE key alone (job 21's units: "
        "nothing fitted)", "3.8 min a cell alone, 9-15 beside CI",
        ("experiment=smol_frontier", "precision=cmxfp4r16,c16rmxfp4", "method=quantmla",
         "method.calibration.seqlen=512")),
    Job("MXFP4 per path, QuaRot† and RTN", "... and the same caches under QuaRot† and RTN",
        "9-15 min a cell beside CI",
        ("experiment=smol_frontier", "precision=cmxfp4r16,c16rmxfp4", "method=quarot,rtn")),
    # job 54: QuaRot†'s mean NMSE on nvfp4_ds_mla (5.33e-3) is above RTN's (3.73e-3) though its
    # perplexity is lower; layers 5-8 carry it (4.8e-2 at layer 5 against RTN's 1.5e-2)
    Job("NVFP4 per path, QuaRot†", "which path raises QuaRot†'s output error above RTN's on "
        "nvfp4_ds_mla in layers 5-8: its NVFP4 latent alone (BF16 key) and its FP8 key alone, beside "
        "job 50's RTN cells (nothing fitted)", "3.7-7.6 min a cell",
        ("experiment=smol_frontier", "precision=cnvfp4r16,c16re4m3t", "method=quarot")),
    # docs/results.md: QuantMLA's RoPE path alone trails QuaRot†'s Hadamard after every refit of its
    # per-pair transforms (jobs 30, 33, 36); "what remains is the family" was not measured apart
    Job("RoPE pairs, then an online Hadamard", "whether QuantMLA's RoPE path passes QuaRot†'s when "
        "its fitted per-pair transforms are followed by QuaRot†'s online Hadamard "
        "(method.calibration.rope_hadamard, ours): the family question, measured (the content "
        "units are smol_table1's)", "36 min beside CI (capture 19, α search 5, 300 steps 9), then 4 min a cell",
        ("experiment=smol_table1", "experiment_name=smol_rope_hadamard", "method=quantmla",
         "precision=c16r4,c4r4,c2r4", "method.calibration.rope_hadamard=true")),
    Job("RoPE pairs, then an online Hadamard, MXFP4", "... and on MXFP4, where QuaRot† leads "
        "QuantMLA on C4 (the content units are job 21's)",
        "19 min alone (capture 4, α search 2, 300 steps 10), then 4 min a cell",
        ("experiment=smol_table1", "experiment_name=smol_rope_hadamard", "method=quantmla",
         "precision=c16rmxfp4,cmxfp4rmxfp4", "method.calibration.rope_hadamard=true")),
    # job 13: GSM8K's exact match is 0-2 % in every row, BF16's included, so it ranks nothing; the
    # reference solutions teacher-forced after a shared 5-shot prompt do, one forward a document
    Job("GSM8K reference solutions", "GSM8K column that ranks caches at 135M: each reference "
        "solution's bits per byte after a 5-shot prompt, every row, 250 documents (paired vs BF16)",
        "3.2-6.9 min a cell (250 documents; most beside a CI run)",
        (*SUITE, "eval.tasks=[gsm8k_reference]", "eval.limit=250", *GRID)),
    Job("tiny-mla-v2 GSM8K reference solutions", "the claims table's tiny column of job 60's rows "
        "(tiny-mla-v2 saw GSM8K's train split in training)", "7 min: 9 cells of 250 documents, alone",
        ("experiment=tiny_table1_v2", "eval=table1_suite", "eval.tasks=[gsm8k_reference]",
         "eval.limit=250", *GRID)),
    # job 60: at C2R4 QuantMLA costs +0.016 bits/byte, QuaRot† +0.081, SmoothQuant† +0.092 (the
    # paper's order; perplexity puts SmoothQuant† ahead of QuaRot†): which path carries each
    Job("GSM8K reference solutions per path", "job 60's C2R4 rows with one path quantized: the "
        "INT2 latent alone (C2R16) and the INT4 RoPE key alone (C16R4), every method (the path "
        "split's units: nothing fitted)", "4.6-6.7 min a cell (most beside a CI run)",
        ("experiment=smol_table1", "experiment_name=smol_path_split", "eval=table1_suite",
         "eval.tasks=[gsm8k_reference]", "eval.limit=250", "precision=c2r16,c16r4",
         "method=quantmla,rtn,quarot,smoothquant")),
    # job 62: SmoothQuant†'s two paths cost +0.023 bits/byte more together than alone; WikiText-2's
    # NMSE shows no such excess: the same windows' measures on GSM8K's own text
    Job("GSM8K text per path", "perplexity and attention-output NMSE on the GSM8K test set's "
        "question-and-answer text (8 windows of 2,048; NMSE on 4): BF16 and every method at C2R4, "
        "C2R16 and C16R4, whether each method's paths interact on GSM8K's text as on its solutions",
        "2.3-6.5 min a cell (beside other jobs)",
        ("experiment=smol_table1", "experiment_name=smol_path_split_gsm8k", "eval.datasets=[gsm8k]",
         "+eval.splits.gsm8k=test", "precision=bf16,c2r4,c2r16,c16r4",
         "method=quantmla,rtn,quarot,smoothquant")),
    # job 63: on GSM8K's text SmoothQuant†'s paths add up; job 62's 250 documents share one 5-shot
    # prefix: the same solutions after each document's own shots (upstream gsm8k's prompts)
    Job("GSM8K reference solutions, drawn shots", "job 60's and 62's cells with each document's "
        "own 5 shots (lm-eval's seeded sampler), 100 documents: whether SmoothQuant†'s path "
        "interaction and the C2R4 order hold on prompts that share no quantized prefix",
        "8-13 min a cell beside other jobs (100 whole prompts, median 1,144 tokens)",
        ("experiment=smol_table1", "experiment_name=smol_gsm8k_drawn", "eval=table1_suite",
         "eval.tasks=[gsm8k_reference_drawn]", "eval.limit=100", "precision=bf16,c2r4,c2r16,c16r4",
         "method=quantmla,rtn,quarot,smoothquant")),
    # job 60: at C4R4 QuantMLA − SmoothQuant† is +0.0017 ± 0.0011 bits/byte over 250 documents,
    # not separated; the whole test set (1,319) shrinks the standard error about 2.3x
    Job("GSM8K reference solutions, whole test set, C4R4", "the C4R4 GSM8K claim row over all "
        "1,319 test documents (job 60's task and prompt; its own experiment, so no table pairs "
        "records of different document sets)", "30-33 min a cell beside a QuantMLA fit",
        (*SUITE, "experiment_name=smol_gsm8k_full", "eval.tasks=[gsm8k_reference]",
         "precision=bf16,c4r4", "method=quantmla,rtn,quarot,smoothquant")),
    # job 48: mixed QuantMLA at 152 B beats uniform C2R8 there; the other uniform format at 152 B
    Job("Frontier, C3R4, QuantMLA", "uniform QuantMLA C3R4 (C2R8's 152 B) beside job 48's mixed "
        "allocation at 152 B (job 46's INT3 content units, C4R4's INT4 RoPE units: nothing fitted)",
        "not measured: ~5-15 min",
        ("experiment=smol_frontier", "precision=c3r4", "method=quantmla",
         "method.calibration.seqlen=512")),
    # job 65: over all 1,319 documents SmoothQuant† is ahead of QuantMLA at C4R4 (−0.0021 ± 0.0005
    # bits/byte) while its RoPE key alone (C16R4, job 62) is behind QuantMLA's: the latent alone
    Job("GSM8K reference solutions per path, C4R4", "job 60's C4R4 rows with the INT4 latent alone "
        "(C4R16; the RoPE key alone is job 62's C16R4), every method (C4R4's units: nothing fitted)",
        "6-8 min a cell beside a QuantMLA fit",
        ("experiment=smol_table1", "experiment_name=smol_path_split", "eval=table1_suite",
         "eval.tasks=[gsm8k_reference]", "eval.limit=250", "precision=c4r16",
         "method=quantmla,smoothquant,quarot,rtn")),
)  # fmt: skip


def commit_results(repo: Path, message: str) -> bool:
    """Commit what changed under `results/` (records, progress, artifacts) and nothing else, so a
    campaign on a machine that may stop keeps each finished job. Returns whether it committed."""
    if not (repo / "results").is_dir():
        return False
    subprocess.run(["git", "add", "-A", "--", "results/"], cwd=repo, check=True)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", "results/"], cwd=repo)
    if staged.returncode == 0:
        return False
    subprocess.run(["git", "commit", "-q", "-m", message, "--", "results/"], cwd=repo, check=True)
    return True


def job_numbers(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: job numbers, e.g. 3 or 7,8,22") from None


def job_env() -> dict[str, str]:
    """The jobs' environment: OpenMP threads that sleep while they wait (unless set). A campaign
    often shares the 2 cores with other work (a CI run), where spinning waits made a 4 x 576 by
    576 x 1,536 matmul 16 ms instead of 0.2 and a SmolLM2-MLA prefill 52 s instead of 29; alone
    the two policies are level (16.4 vs 16.8 s)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="print the jobs and stop")
    parser.add_argument("--from", dest="start", type=int, default=1, help="first job (1-based)")
    parser.add_argument(
        "--only", type=job_numbers, default=None, help="these jobs alone, in this order (7,8,22)"
    )
    parser.add_argument(
        "--commit", action="store_true", help="git-commit the results store after each job"
    )
    args = parser.parse_args(argv)
    for value, field in ((args.start, "--from"), *((n, "--only") for n in args.only or ())):
        if not 1 <= value <= len(JOBS):
            parser.error(f"{field} {value}: a job number from 1 to {len(JOBS)}")
    chosen = args.only or list(range(args.start, len(JOBS) + 1))
    if args.list:
        for i, job in enumerate(JOBS, 1):
            print(f"{i:2d}. {job.name} ({job.cost}): {job.gives}")
            print(f"    python -m quantmla.run {' '.join(job.overrides)}")
        return 0
    failed = []
    for i in chosen:
        job = JOBS[i - 1]
        print(
            f"[campaign] {i}/{len(JOBS)} {job.name} ({job.cost}) at {time.strftime('%H:%M')}",
            flush=True,
        )
        done = subprocess.run([sys.executable, "-m", "quantmla.run", *job.overrides], env=job_env())
        if done.returncode:
            failed.append(f"{i}. {job.name} (exit {done.returncode})")
        if args.commit and commit_results(REPO, f"Campaign job {i}, {job.name}: records"):
            print(f"[campaign] job {i}'s results committed", flush=True)
    if failed:
        print("[campaign] failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
