"""Child-process side of quantmla.evaluation.lm_eval.sandbox (standard library only, run with `python -I -S`).

Reads {code, public, private, func_name, seconds_per_test} as JSON on stdin, blocks sockets, runs
every test and prints one JSON line {"passed", "reason"}."""

import base64
import io
import json
import math
import pickle
import signal
import socket
import sys
import zlib


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")


def block_network():
    socket.socket = _no_network
    socket.create_connection = _no_network
    socket.socketpair = _no_network
    socket.getaddrinfo = _no_network


def decode_tests(raw):
    """LiveCodeBench tests: a list, JSON text, or base64(zlib(pickle(JSON text)))."""
    if raw is None:
        return []
    if isinstance(raw, list):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return json.loads(pickle.loads(zlib.decompress(base64.b64decode(raw.encode()))))


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout


def same_output(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace ignored; numbers equal within 1e-6 where text differs."""
    a = [line.rstrip() for line in got.strip().splitlines()]
    b = [line.rstrip() for line in expected.strip().splitlines()]
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        tx, ty = x.split(), y.split()
        if len(tx) != len(ty):
            return False
        for u, v in zip(tx, ty):
            if u == v:
                continue
            try:
                if not math.isclose(float(u), float(v), rel_tol=1e-6, abs_tol=1e-6):
                    return False
            except ValueError:
                return False
    return True


def _normalise(value):
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return value


def run_stdin(code, test):
    stdin, stdout = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.StringIO(test["input"]), io.StringIO()
    try:
        exec(compile(code, "<solution>", "exec"), {"__name__": "__main__"})
        return same_output(sys.stdout.getvalue(), test["output"])
    except SystemExit:
        return same_output(sys.stdout.getvalue(), test["output"])
    finally:
        sys.stdin, sys.stdout = stdin, stdout


def run_functional(namespace, func_name, test):
    args = [json.loads(line) for line in test["input"].split("\n") if line.strip()]
    target = namespace["Solution"]() if "Solution" in namespace else None
    fn = getattr(target, func_name) if target is not None else namespace[func_name]
    return _normalise(fn(*args)) == _normalise(json.loads(test["output"]))


def main(job):
    block_network()
    tests = decode_tests(job["public"]) + decode_tests(job["private"])
    if not tests:
        return {"passed": False, "reason": "no tests"}
    signal.signal(signal.SIGALRM, _alarm)
    namespace = None
    for i, test in enumerate(tests):
        signal.setitimer(signal.ITIMER_REAL, job["seconds_per_test"])
        try:
            if test.get("testtype", "stdin") == "functional":
                if namespace is None:
                    namespace = {"__name__": "solution"}
                    exec(compile(job["code"], "<solution>", "exec"), namespace)
                ok = run_functional(namespace, job["func_name"], test)
            else:
                ok = run_stdin(job["code"], test)
        except Timeout:
            return {"passed": False, "reason": f"test {i}: time limit"}
        except BaseException as err:  # noqa: BLE001 - any failure of the program fails the test
            return {"passed": False, "reason": f"test {i}: {type(err).__name__}: {err}"[:200]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if not ok:
            return {"passed": False, "reason": f"test {i}: wrong answer"}
    return {"passed": True, "reason": f"{len(tests)} tests"}


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    nonce = job.pop("nonce")
    verdict = main(job)
    sys.__stdout__.write(f"{nonce} {json.dumps(verdict)}\n")
