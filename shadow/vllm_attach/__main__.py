"""Check this machine's vLLM against slotmap: a model config served offline (random weights), every step shadowed.

    .venv-vllm/bin/python -m shadow.vllm_attach --model tests/live_vllm/models/llama
    .venv-vllm/bin/python -m shadow.vllm_attach --model tests/live_vllm/models/gemma2 --blocks 24 --ngram 3

`--model` is a folder with a Hugging Face `config.json` (no weights, no tokenizer: `load_format="dummy"`,
token-id prompts). Few `--blocks` force preemption; prompts share a prefix (prefix-cache hits) and are
longer than `--chunk` (chunked prefill). Exit status 0: every step agreed; 1: a divergence or a refusal,
printed with its step, request, field and reproduction script.
"""

from __future__ import annotations

import argparse
import os
import random
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shadow.vllm_attach", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a folder with a config.json")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64, help="KV cache blocks (num_gpu_blocks_override)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's CPU attention needs a multiple of 32")
    parser.add_argument("--chunk", type=int, default=64, help="max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--ngram", type=int, default=0, help="n-gram speculative decoding with this many drafts")
    parser.add_argument("--repro-dir", default=None, help="where a divergence's reproduction script goes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model runner in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from shadow.checker import ShadowMismatchError, ShadowRefusalError
    from shadow.vllm_attach import attach
    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba

    extra = {}
    if args.ngram:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}  # fmt: skip
    let_vllm_scan_modules_beside_numba()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              block_size=args.block_size, max_model_len=args.max_model_len, max_num_batched_tokens=args.chunk,
              num_gpu_blocks_override=args.blocks, enable_prefix_caching=True, seed=args.seed, **extra)  # fmt: skip
    shadow = attach(llm, repro_dir=args.repro_dir)
    rng = random.Random(args.seed)
    vocab = shadow.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(2 * args.block_size)]
    prompts = []
    for _ in range(args.requests):
        body = [rng.randrange(vocab) for _ in range(rng.randint(4, 3 * args.chunk))]
        prompts.append(prefix + body if rng.random() < 0.5 else body)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    except (ShadowMismatchError, ShadowRefusalError) as report:
        print(f"slotmap: vLLM and spec disagree after {shadow.steps_checked} agreeing steps:\n{report}")
        return 1
    finally:
        llm.llm_engine.engine_core.shutdown()
    groups = ", ".join(
        f"block size {g.block_size}" + (f" window {g.sliding_window}" if g.sliding_window else "")
        for g in shadow.config.kv_groups
    )
    print(f"slotmap: {shadow.steps_checked} steps of vLLM's model runner agree with spec ({len(prompts)} requests; "
          f"KV groups: {groups})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
