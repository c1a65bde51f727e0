"""A stopped lm-eval job on vLLM resumes from the answers it saved (`eval.engine=vllm`, RULER): the
worker's model saves each chunk under the key lm-eval's request cache looks up. No engine is
started: lm-eval's generation is replaced by a stand-in that saves as lm-eval 0.4.13 does."""

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import CachingLM

from quantmla.evaluation.lm_eval.vllm_worker import RESUME_CHUNK, resumable_vllm


class Stopped(Exception):
    pass


def test_a_stopped_generation_resumes_from_its_saved_chunks(tmp_path, monkeypatch):
    calls = []

    def generate(self, requests, disable_tqdm=False):
        if len(calls) == stop_at:
            raise Stopped
        calls.append(len(requests))
        texts = []
        for req in requests:
            context, kwargs = req.args
            texts.append(f"answer to {context}")
            # lm-eval's own save: under its normalised arguments, never read back
            normalised = {"until": [*kwargs["until"], "<eos>"], "max_gen_toks": 8}
            self.cache_hook.add_partial("generate_until", (context, normalised), texts[-1])
        return texts

    model = resumable_vllm()
    monkeypatch.setattr(model.__base__, "generate_until", generate)  # lm-eval's VLLM
    n = RESUME_CHUNK + 4
    requests = [
        Instance("generate_until", {}, (f"prompt {i}", {"until": ["\n"]}), idx=i) for i in range(n)
    ]
    db = str(tmp_path / "progress-lm_eval_rank0.db")

    stop_at = 1  # the job stops after its first chunk
    with pytest.raises(Stopped):
        CachingLM(object.__new__(model), db).generate_until(requests)
    assert calls == [RESUME_CHUNK]

    calls.clear()
    stop_at = None
    answers = CachingLM(object.__new__(model), db).generate_until(requests)
    assert calls == [n - RESUME_CHUNK]  # the saved chunk is not generated again
    assert answers == [f"answer to prompt {i}" for i in range(n)]
