"""`python -m quantmla.generate prompt="..." max_new_tokens=N precision=c4r4 cache.backend=packed`

Prepares the model as every job does (method, fusion, equivalence check), continues the prompt
greedily through the chosen cache, and prints the continuation, tokens/s and the cache bytes held
(measured from tensor storage) beside the BF16 latent cache of the same tokens. Any prompt text
works as `prompt=...` (it is quoted for Hydra here), or `prompt_file=PATH` (`-`: standard input).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: the packed pools, or every tensor of the other layers."""
    from quantmla.cache.packed import PackedLatentLayer, packed_bytes

    total = packed_bytes(cache)
    for layer in cache.layers:
        if not isinstance(layer, PackedLatentLayer):
            for t in vars(layer).values():
                if hasattr(t, "untyped_storage"):
                    total += t.numel() * t.element_size()
    return total


def read_prompt(cfg) -> str:
    """The prompt text (`prompt_file` wins: a path, or `-` for standard input); one line if empty."""
    from quantmla.errors import ConfigError

    if cfg.prompt_file:
        field = "prompt_file"
        if cfg.prompt_file == "-":
            text = sys.stdin.read()
        else:
            try:
                text = open(cfg.prompt_file, encoding="utf-8").read()  # noqa: SIM115
            except OSError as err:
                raise ConfigError(
                    field, cfg.prompt_file, f"a readable text file ({err.strerror})"
                ) from None
    else:
        field, text = "prompt", cfg.prompt
    if not text.strip():
        raise ConfigError(field, text, "some text to continue")
    return text


def size_line(held: int, bf16: int, backend: str = "packed") -> str:
    """How the cache held compares with the BF16 latent cache of the same tokens (never inverted)."""
    if held <= bf16:
        return f"{bf16 / held:.2f}x smaller than BF16"
    why = (
        "the fixed protection buffers dominate short contexts"
        if backend == "packed"
        else "the simulated cache keeps a raw and a dequantized copy in the model's dtype"
    )
    return f"{held / bf16:.2f}x the BF16 bytes: {why}"


def generate(cfg) -> dict:
    from quantmla.errors import ConfigError

    if cfg.max_new_tokens < 1:
        raise ConfigError("max_new_tokens", cfg.max_new_tokens, ">= 1")
    prompt = read_prompt(cfg)
    from quantmla.job import resolve

    job = resolve(cfg)
    import torch
    from transformers import DynamicCache

    from quantmla.prepare import prepare

    prepared = prepare(job)
    model, tokenizer = prepared.model, prepared.tokenizer
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    if ids.shape[1] == 0:
        raise ConfigError("prompt", prompt, "text the tokenizer turns into at least one token")
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=cfg.max_new_tokens, do_sample=False, cache=cache)
    seconds = time.perf_counter() - started
    new = out[0, ids.shape[1] :]
    tokens = ids.shape[1] + len(new) - 1
    geometry = prepared.adapter.geometry(prepared.modules[0])
    bf16 = len(prepared.modules) * tokens * (geometry.d_c + geometry.d_r) * 2
    held = cache_bytes(cache)
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    print(tokenizer.decode(out[0, : ids.shape[1]]) + bold + tokenizer.decode(new) + plain)
    print(
        f"[quantmla] {len(new)} tokens in {seconds:.2f} s = {len(new) / seconds:.1f} tokens/s "
        f"({cfg.precision.name}, cache.backend={cfg.cache.backend}, kernel={prepared.policy.kernel})"
    )
    print(
        f"[quantmla] cache bytes held for {tokens} tokens × {len(prepared.modules)} layers: "
        f"{held:,} (BF16 latent cache of the same tokens: {bf16:,}; {size_line(held, bf16, cfg.cache.backend)})"
    )
    result = {
        "text": tokenizer.decode(new),
        "prompt_token_ids": ids[0].tolist(),
        "token_ids": new.tolist(),
        "tokens_per_s": len(new) / seconds,
        "bytes": held,
        "bf16_bytes": bf16,
    }
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(result) + "\n")
    return result


_PROMPT_ARG = re.compile(r"(prompt=)(.*)", re.DOTALL)


def quote_prompt(argv: list[str]) -> list[str]:
    """`prompt=<any text>` → Hydra's quoted form, so commas, accents and quotes need no escaping;
    a value already quoted by the user is left alone."""
    out = []
    for arg in argv:
        match = _PROMPT_ARG.fullmatch(arg)
        if match and not (
            len(match[2]) >= 2 and match[2][0] == match[2][-1] and match[2][0] in "'\""
        ):
            escaped = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), match[2])
            arg = f"prompt='{escaped}'"
        out.append(arg)
    return out


def main() -> None:
    from quantmla.cli import hydra_app, route_precision

    sys.argv[1:] = quote_prompt(route_precision(sys.argv[1:]))
    try:
        hydra_app("generate", generate)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
