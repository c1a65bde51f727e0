"""Run model-written Python against test cases in a child process: no network, CPU-time, wall-time
and memory limits, an empty working folder, a minimal environment. Only with the explicit opt-in
HF_ALLOW_CODE_EVAL=1 (lm-eval's own switch for its code tasks).

Test cases come as LiveCodeBench stores them: `stdin` tests (program reads input, prints output)
or `functional` tests (call `Solution().<func_name>(*args)`, one JSON argument per input line);
private tests may be compressed (base64 → zlib → pickle → JSON) and are decoded inside the child,
never in the evaluating process."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from quantmla.evaluation.lm_eval.suites import CODE_EVAL_ENV

HARNESS = Path(__file__).with_name("sandbox_harness.py")


class CodeExecutionNotAllowed(RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    seconds_per_test: float = 6.0
    memory_mb: int = 1024
    max_wall_seconds: float = 120.0


def require_opt_in() -> None:
    if os.environ.get(CODE_EVAL_ENV) != "1":
        raise CodeExecutionNotAllowed(
            f"refusing to execute model-written code: set {CODE_EVAL_ENV}=1 to allow it"
        )


@cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare -rn` (a private network namespace with no interfaces) where the kernel allows
    unprivileged user namespaces; otherwise () and the harness's socket block alone applies."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = (
            subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


def _limit(memory_mb: int, cpu_seconds: int):
    def apply():
        import resource

        memory = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**24, 2**24))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_tests(
    code: str,
    public_tests: str | list,
    private_tests: str | list | None = None,
    func_name: str | None = None,
    limits: Limits = Limits(),
) -> dict:
    """{"passed": bool, "reason": str}: every test must pass; the first failure stops."""
    require_opt_in()
    nonce = secrets.token_hex(8)  # marks the harness's verdict line among the program's output
    payload = json.dumps(
        {
            "nonce": nonce,
            "code": code,
            "public": public_tests,
            "private": private_tests,
            "func_name": func_name,
            "seconds_per_test": limits.seconds_per_test,
        }
    )
    with tempfile.TemporaryDirectory(prefix="quantmla-sandbox-") as work:
        command = [*network_namespace_prefix(), sys.executable, "-I", "-S", str(HARNESS)]
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "HOME": work}
        try:
            proc = subprocess.run(
                command,
                input=payload,
                capture_output=True,
                text=True,
                cwd=work,
                env=env,
                timeout=limits.max_wall_seconds,
                preexec_fn=_limit(limits.memory_mb, int(limits.max_wall_seconds)),
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return {"passed": False, "reason": "wall-time limit"}
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(nonce + " ")]
    if proc.returncode != 0 or not verdicts:
        return {"passed": False, "reason": f"harness exit {proc.returncode}: {proc.stderr[-300:]}"}
    return json.loads(verdicts[-1][len(nonce) + 1 :])
