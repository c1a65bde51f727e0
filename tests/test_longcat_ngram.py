"""LongCat-Flash-Lite (`longcat_flash_ngram`): n-gram ids against a Python-integer reference written
from the formulas, incremental decoding against full recompute, left-padded batches, the published
checkpoint format (save → load, missing and mis-shaped tables, `mtp` ignored), FP8, the refusals."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from quantmla.errors import CheckpointError, ConfigError
from quantmla.models.loading import config_from_dict, config_from_file, load_pretrained
from quantmla.models.longcat_ngram import hash_powers, ngram_ids
from tests.conftest import DATA_DIR, REPO

needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data")

LITE = REPO / "assets" / "model-configs" / "longcat-flash-lite.json"


def reference_ids(seq, vocab, ratio, n, k, eos, history=()):
    """Table ids of every token of `seq` from the definition, in Python integers: the n-gram as one
    base-V number (current token lowest), reduced mod M + 2·idx + 1 once; a predecessor exists only
    inside the token's EOS-terminated segment (earlier tokens in `history`)."""
    tokens = list(history) + list(seq)
    out = []
    for t in range(len(history), len(tokens)):
        row = []
        for order in range(2, n + 1):
            number, power = tokens[t], vocab
            for back in range(1, order):
                p = t - back
                if p < 0 or tokens[p] in eos:
                    break
                number += tokens[p] * power
                power *= vocab
            for j in range(k):
                row.append(number % (ratio * vocab + 2 * ((order - 2) * k + j) + 1))
        out.append(row)
    return out


def ours(seq_batch, config, history=None, valid=None):
    powers = torch.tensor(hash_powers(config))
    rows = torch.tensor(config.ngram_table_rows)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return ngram_ids(torch.tensor(seq_batch), powers, rows, eos, history, valid)


def small_config(vocab, ratio, n, k, eos, hidden=None):
    tables = k * (n - 1)
    return SimpleNamespace(
        vocab_size=vocab,
        emb_neighbor_num=n,
        emb_split_num=k,
        eos_token_id=eos,
        hidden_size=hidden or 8 * tables,
        ngram_table_rows=[ratio * vocab + 2 * i + 1 for i in range(tables)],
    )


@pytest.mark.parametrize(
    "vocab,ratio,n,k",
    [(50, 3, 2, 1), (97, 5, 3, 2), (1000, 78, 4, 4), (131072, 78, 4, 4), (7, 1, 4, 3)],
    ids=["order2", "order3", "lite-ratio", "lite-real", "tiny-vocab"],
)
def test_ngram_ids_equal_the_python_integer_reference(vocab, ratio, n, k):
    eos = 2
    g = torch.Generator().manual_seed(vocab)
    seq = torch.randint(0, vocab, (40,), generator=g).tolist()
    seq[0] = seq[17] = seq[18] = seq[-1] = eos  # EOS at the start, twice in the middle, at the end
    seq[5] = vocab - 1  # the largest digit
    config = small_config(vocab, ratio, n, k, eos)
    ids, history = ours([seq], config)
    assert ids[0].tolist() == reference_ids(seq, vocab, ratio, n, k, {eos})
    assert history[0].tolist() == seq[-(n - 1) :]


def test_the_published_config_gives_twelve_tables_of_odd_moduli():
    config = config_from_file(LITE)
    assert type(config).__name__ == "LongcatFlashNgramConfig"
    assert config.ngram_tables == 12 and config.hidden_size // config.ngram_tables == 256
    assert config.ngram_table_rows == [78 * 131072 + 2 * i + 1 for i in range(12)]
    seq = [131071, 5, 2, 131071, 131071, 131071, 7]
    assert ours([seq], config)[0][0].tolist() == reference_ids(seq, 131072, 78, 4, 4, {2})


def test_ids_in_chunks_with_history_equal_ids_of_the_whole_sequence():
    config = small_config(97, 5, 4, 2, eos=[2, 3])
    seq = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    seq[0, 9], seq[1, 10] = 2, 3
    whole, _ = ours(seq.tolist(), config)
    history, parts = None, []
    for chunk in (seq[:, :1], seq[:, 1:10], seq[:, 10:11], seq[:, 11:]):
        ids, history = ours(chunk.tolist(), config, history)
        parts.append(ids)
    assert torch.equal(torch.cat(parts, 1), whole)


def test_padding_counts_as_missing():
    config = small_config(97, 5, 4, 2, eos=2)
    seq = [11, 12, 13, 14, 15]
    padded = [[0, 0, 0, *seq]]  # left padding with a real token id (0)
    valid = torch.tensor([[False] * 3 + [True] * 5])
    ids, _ = ours(padded, config, valid=valid)
    assert ids[0, 3:].tolist() == reference_ids(seq, 97, 5, 4, 2, {2})


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("emb_split_num", None, "emb_split_num"),
        ("emb_neighbor_num", 1, "emb_neighbor_num"),
        ("hidden_size", 3070, "hidden_size"),
        ("ngram_vocab_size_ratio", 0.3, "ngram_vocab_size_ratio"),
        ("mla_scale_q_lora", False, "mla_scale_q_lora"),
        ("norm_topk_prob", True, "norm_topk_prob"),
        ("zero_expert_type", "copy", "zero_expert_type"),
    ],
)
def test_fields_the_classes_cannot_honour_are_refused_in_one_line(field, value, named):
    raw = json.loads(LITE.read_text())
    raw[field] = value
    with pytest.raises(ConfigError, match=rf"^{named}=") as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value)


# -- the tiny twin ------------------------------------------------------------------------------


def twin(dtype=torch.float64, seed=0):
    from experiments.make_longcat_lite_twin import tiny_lite

    model, tokenizer = tiny_lite(
        seed, dtype=dtype, heads=4, ffn_size=32, experts_implementation="eager"
    )
    return model, tokenizer


@pytest.fixture(scope="module")
def twin64():
    return twin()[0]


def test_the_twin_keeps_the_published_geometry(twin64):
    c = twin64.config
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.q_lora_rank, c.hidden_size) == (
        512,
        64,
        1536,
        3072,
    )
    assert (c.emb_neighbor_num, c.emb_split_num, c.ngram_tables) == (4, 4, 12)
    assert all(t.weight.shape[1] == 256 for t in twin64.model.ngram_embeddings.embedders)
    experts = twin64.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == c.n_routed_experts  # zero experts: no weights
    assert experts.down_proj.shape[0] == c.n_routed_experts and c.zero_expert_num > 0


def sequence_with_eos(twin64, length=14, seed=0):
    ids = torch.randint(
        3, twin64.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed)
    )
    ids[0, 5] = ids[1, length // 2] = twin64.config.eos_token_id
    return ids


@pytest.mark.parametrize("chunks", [[1] * 14, [4, 1, 6, 3]], ids=["token-by-token", "chunks"])
def test_incremental_decoding_equals_full_recompute(twin64, chunks):
    from transformers import DynamicCache

    ids = sequence_with_eos(twin64)
    with torch.no_grad():
        full = twin64(ids).logits
        cache, parts, start = DynamicCache(config=twin64.config), [], 0
        for size in chunks:
            parts.append(twin64(ids[:, start : start + size], cache=cache, use_cache=True).logits)
            start += size
    # float64 weights, but transformers' RMSNorms compute in float32: the two paths agree to float32
    # rounding, which BLAS's shape-dependent summation order can flip (2.3e-7 relative measured on
    # one CPU, 0 on another); a wrong n-gram history errs by O(1) (test_the_ngram_embedding_matters)
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5 * full.abs().max()


def test_the_ngram_embedding_matters(twin64):
    """Guards the equalities above against a front end that ignores the history: shifting one
    earlier token changes a later token's embedding only through its n-grams."""
    ids = sequence_with_eos(twin64)
    other = ids.clone()
    other[:, 10] = (ids[:, 10] + 1) % twin64.config.vocab_size
    with torch.no_grad():
        a, b = (twin64.model.embed(x) for x in (ids, other))
    assert torch.equal(a[:, :10], b[:, :10]) and torch.equal(a[:, 14:], b[:, 14:])
    assert (a[:, 11:14] - b[:, 11:14]).abs().amax((0, 2)).min() > 0  # 3 tokens look back to it


def test_greedy_generate_equals_full_recompute(twin64):
    ids = sequence_with_eos(twin64)[:, :6]
    with torch.no_grad():
        out = twin64.generate(
            ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        full = twin64(out.sequences).logits[:, 5:-1]
    scores = torch.stack(out.scores, 1)  # generate hands scores back in float32
    assert (scores.double() - full).abs().max() <= 1e-5 * full.abs().max()  # float32 norms, above


def test_left_padded_batch_generates_each_sequence_as_alone(twin64):
    long, short = sequence_with_eos(twin64, 9, seed=3)
    short = short[:5]  # its EOS at index 4: the first generated token looks back from nothing
    pad = twin64.config.pad_token_id
    batch = torch.stack([long, torch.cat([torch.full((4,), pad), short])])
    mask = torch.stack([torch.ones(9), torch.cat([torch.zeros(4), torch.ones(5)])]).long()
    kwargs = dict(
        max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        both = twin64.generate(batch, attention_mask=mask, **kwargs)
        alone = [twin64.generate(x[None], **kwargs) for x in (long, short)]
    for row, single in enumerate(alone):
        assert torch.equal(both.sequences[row, 9:], single.sequences[0, -5:])
        a, b = torch.stack(both.scores, 1)[row], torch.stack(single.scores, 1)[0]
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()  # float64 model, float32 scores


def test_a_cache_without_its_history_is_refused(twin64):
    from transformers import DynamicCache

    ids = sequence_with_eos(twin64)
    cache = DynamicCache(config=twin64.config)
    with torch.no_grad():
        twin64(ids[:, :4], cache=cache, use_cache=True)
        cache.crop(-1)  # as assisted decoding does
        with pytest.raises(ConfigError, match="n-gram history"):
            twin64(ids[:, 3:4], cache=cache, use_cache=True)
    with pytest.raises(ConfigError, match="num_beams"):
        twin64.generate(ids[:, :4], num_beams=2, max_new_tokens=2)


# -- the published checkpoint format ----------------------------------------------------------

PUBLISHED_KEYS = [
    r"model\.embed_tokens\.weight",
    r"lm_head\.weight",
    r"model\.norm\.weight",
    r"model\.ngram_embeddings\.(embedders|post_projs)\.\d+\.weight",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.[01]\.weight",
    r"model\.layers\.\d+\.self_attn\.[01]\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_a_layernorm|kv_a_layernorm)\.weight",
    r"model\.layers\.\d+\.mlps\.[01]\.(gate_proj|up_proj|down_proj)\.weight",
    r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight",
    r"model\.layers\.\d+\.mlp\.router\.(classifier\.weight|e_score_correction_bias)",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, tokenizer = twin(torch.float32)
    folder = tmp_path_factory.mktemp("lite")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_save_writes_the_published_key_names(saved):
    folder, model = saved
    names = tensors(folder)
    assert all(any(re.fullmatch(p, k) for p in PUBLISHED_KEYS) for k in names), sorted(names)
    experts = {k for k in names if ".mlp.experts." in k and k.startswith("model.layers.0.")}
    assert len(experts) == 3 * model.config.n_routed_experts  # none for the zero experts
    assert json.loads((folder / "config.json").read_text())["model_type"] == "longcat_flash_ngram"


def test_load_round_trip_gives_identical_logits(saved):
    folder, model = saved
    loaded, _ = load_pretrained(str(folder), dtype="float32")
    loaded.set_attn_implementation(model.config._attn_implementation)  # the weights are compared
    ids = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def rewrite(saved, tmp_path, change):
    import shutil

    from safetensors.torch import save_file

    folder, _ = saved
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    state = tensors(folder)
    change(state)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_mtp_tensors_are_ignored(saved, tmp_path):
    folder, model = saved
    target = rewrite(
        saved, tmp_path, lambda s: s.update({"model.mtp.layers.0.eh_proj.weight": torch.ones(4, 4)})
    )
    loaded, _ = load_pretrained(str(target), dtype="float32")
    loaded.set_attn_implementation(model.config._attn_implementation)  # the weights are compared
    ids = torch.arange(10)[None] + 5
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("how", ["missing", "mis-shaped"])
def test_a_bad_ngram_table_stops_in_one_line_naming_the_key(saved, tmp_path, how):
    key = "model.ngram_embeddings.embedders.7.weight"

    def change(state):
        if how == "missing":
            del state[key]
        else:
            state[key] = state[key][:-1]

    target = rewrite(saved, tmp_path, change)
    with pytest.raises(CheckpointError, match=re.escape(key)) as err:
        load_pretrained(str(target), dtype="float32")
    assert "\n" not in str(err.value)


def test_an_fp8_checkpoint_loads_dequantized(saved, tmp_path):
    from experiments.make_fp8_checkpoint import write_fp8
    from quantmla.models.fp8 import dequantize_blocks

    folder, model = saved
    write_fp8(model.to(torch.bfloat16), tmp_path / "fp8")
    model.float()
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "fp8" / extra).write_bytes((folder / extra).read_bytes())
    stored = tensors(tmp_path / "fp8")
    proj = "model.ngram_embeddings.post_projs.3.weight"
    assert stored[proj].dtype == torch.float8_e4m3fn  # projections FP8, tables kept BF16
    assert stored["model.ngram_embeddings.embedders.3.weight"].dtype == torch.bfloat16
    loaded, _ = load_pretrained(str(tmp_path / "fp8"), fp8="dequantize")
    expected = dequantize_blocks(stored[proj], stored[proj.replace(".weight", ".weight_scale_inv")])
    assert torch.equal(
        loaded.model.ngram_embeddings.post_projs[3].weight, expected.to(torch.bfloat16)
    )
    expert = loaded.model.layers[1].mlp.experts.gate_up_proj
    assert expert.shape[0] == model.config.n_routed_experts


def test_lm_eval_hflm_scores_and_generates_padded_batches_as_single_requests():
    """lm-eval's HFLM pads loglikelihood batches on the right (no token looks forward, so nothing
    changes) and generation batches on the left (padding counts as missing history)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = twin()
    texts = ["The cat sat on", "A much longer context, with more words than the others", "Hi"]
    pairs = [(t, " the mat") for t in texts]

    def requests(kind, args):
        return [Instance(kind, {}, a, idx=i) for i, a in enumerate(args)]

    batched = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, device="cpu")
    single = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")
    scores = batched.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logprob, _) in zip(pairs, scores):
        ctx = tokenizer(context)["input_ids"]
        cont = tokenizer(context + continuation)["input_ids"][len(ctx) :]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = model(ids).logits.log_softmax(-1)[0, len(ctx) - 1 : -1]
        assert logprob == pytest.approx(
            logp.gather(1, torch.tensor(cont)[:, None]).sum().item(), rel=1e-6
        )
    until = {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": False}
    gen = [(t, until) for t in texts]
    assert batched.generate_until(requests("generate_until", gen)) == single.generate_until(
        requests("generate_until", gen)
    )


# -- the project's jobs on the twin -----------------------------------------------------------


def twin_job(tmp_path, folder, *overrides):
    from tests.conftest import run_config, tiny_job

    return run_config(
        *tiny_job(tmp_path),
        "model=longcat_flash_lite",
        f"model.path={folder}",
        "model.device=cpu",
        "model.dtype=float32",
        "model.eval_seqlen=128",
        *overrides,
    )


@needs_data
def test_rtn_and_sensitivity_jobs_run_on_its_mla_blocks(saved, tmp_path):
    from quantmla.run import run

    folder, model = saved
    blocks = 2 * model.config.num_layers
    record = run(twin_job(tmp_path, folder, "method=rtn", "precision=c4r4", "eval.nmse_windows=1"))
    assert len(record["metrics"]["nmse/attn_layers"]) == blocks
    assert record["metrics"]["ppl/wikitext2"] > 1
    record = run(
        twin_job(tmp_path, folder, "eval=sensitivity", "eval.n_sequences=2", "eval.seqlen=128")
    )
    assert record["metrics"]["sensitivity/layers"] == list(range(blocks))
    assert all(r > 0 for r in record["metrics"]["sensitivity/R_content"])


@needs_data
def test_quantmla_calibrates_fuses_and_passes_the_equivalence_check(saved, tmp_path):
    from quantmla.run import run

    folder, _ = saved
    calibration = ["n_calibration=4", "n_heldout=2", "steps=4", "select_every=2", "batch_size=2"]
    record = run(
        twin_job(
            tmp_path, folder, "method=quantmla", "precision=c4r4",
            *(f"method.calibration.{c}" for c in calibration),
        )
    )  # fmt: skip
    m = record["metrics"]
    assert m["equivalence/max_layer_rel_error"] <= m["equivalence/tolerance"]


@needs_data
def test_export_reloads_to_the_jobs_perplexity(saved, tmp_path):
    from quantmla import patch_model
    from quantmla.checkpoint import load_manifest
    from quantmla.data import load_text, perplexity_windows, tokenize
    from quantmla.evaluation.perplexity import perplexity
    from quantmla.export import export
    from quantmla.run import run
    from tests.test_export import export_config

    folder, _ = saved
    common = [
        "model=longcat_flash_lite", f"model.path={folder}", "model.device=cpu",
        "model.dtype=float32", "model.eval_seqlen=128", "method=smoothquant",
        "method.calibration.n_calibration=4", "method.calibration.n_heldout=2",
        f"paths.data_dir={DATA_DIR}", f"paths.results_dir={tmp_path}/results",
    ]  # fmt: skip
    record = run(twin_job(tmp_path / "results", folder, *common[5:]))
    out = export(export_config(*common, f"out={tmp_path}/export"))
    manifest = load_manifest(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "longcat_flash_ngram"
    model, tokenizer = load_pretrained(str(out), dtype="float32")
    patch_model(
        model,
        manifest["precision"],
        group_size=manifest["quantizer"]["group_size"],
        **manifest["protection"],
    )
    windows = perplexity_windows(
        tokenize(load_text("wikitext2", "test", DATA_DIR), tokenizer), 128, 1
    )
    assert perplexity(model, windows) == record["metrics"]["ppl/wikitext2"]


def test_serving_it_through_vllm_without_cuda_is_refused_in_one_line():
    from quantmla.serving.settings import check_served_family

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: vLLM's own LongCat-Flash-Lite class may run")
    with pytest.raises(
        ConfigError, match=r"^eval.kind=throughput='longcat_flash_ngram'.*eval.engine=hf"
    ):
        check_served_family("longcat_flash_ngram", "eval.kind=throughput")
    check_served_family("deepseek_v2", "eval.kind=throughput")
