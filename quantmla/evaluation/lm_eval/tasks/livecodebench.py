"""LiveCodeBench code generation (code_generation_lite, release_v6: 1,055 problems) as an lm-eval
task: our own prompt wording, the program taken from the completion's last ```python block, pass@1
by running every public and private test in quantmla.evaluation.lm_eval.sandbox (opt-in only)."""

from __future__ import annotations

import json
import re

RELEASE_V6 = ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, 7)]  # cumulative releases 1-6

INSTRUCTION = (
    "Solve the following programming problem in Python 3. Your program must pass hidden tests."
)


def doc_to_text(doc) -> str:
    parts = [INSTRUCTION, "", "Problem:", doc["question_content"].strip(), ""]
    if doc.get("starter_code"):
        parts += [
            "Complete this starter code; return the answer from the method (no printing):",
            "```python",
            doc["starter_code"].rstrip(),
            "```",
        ]
    else:
        parts.append("Read the input from standard input and print the answer to standard output.")
    parts.append("Answer with the whole program in one ```python code block.")
    return "\n".join(parts) + "\n"


def extract_program(completion: str) -> str:
    """The last complete ```python block; else what follows an unclosed opening fence; else the
    whole completion."""
    blocks = re.findall(r"```(?:python3?|py)?[ \t]*\n(.*?)```", completion, flags=re.S)
    if blocks:
        return blocks[-1]
    opened = re.split(r"```(?:python3?|py)?[ \t]*\n", completion, maxsplit=1)
    return opened[1] if len(opened) == 2 else completion


def process_results(doc, results) -> dict:
    from quantmla.evaluation.lm_eval.sandbox import run_tests

    metadata = json.loads(doc.get("metadata") or "{}")
    program = extract_program(results[0])
    verdict = run_tests(
        program, doc["public_test_cases"], doc["private_test_cases"], metadata.get("func_name")
    )
    return {"pass@1": float(verdict["passed"])}
