"""The `pagedllm` command: generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    kwargs = engine_kwargs(args, skip=("model",))
    if kwargs.get("kv_cache_memory_gib") is None and kwargs.get("gpu_memory_utilization") is None:
        kwargs["kv_cache_memory_gib"] = 1.0  # a few prompts: a small cache starts faster
    llm = LLM(model=args.model, **kwargs)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_sampling,
    )
    prompts = args.prompt or ["Name the capital of France."]
    tok = llm.get_tokenizer()
    use_chat = not args.no_chat and bool(getattr(tok, "chat_template", None))
    if use_chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        if len(prompts) > 1:
            print(f"### {p}")
        print(o.outputs[0].text.strip())
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser. Given the arguments it will parse, the benchmark kinds (whose modules
    import httpx and more: ~5 MB resident) are only added when the command is `bench`."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt(s); chat-formatted when the model has a chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    try:
        from pagedllm.entrypoints.openai.cli import add_serve_parser
    except ImportError:  # the server's dependencies (FastAPI, uvicorn) are an optional extra
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    try:
        from pagedllm.bench.cli import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub, with_kinds=argv is None or argv[:1] == ["bench"])
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console command: restart under tcmalloc when installed (host_memory)
        from pagedllm.host_memory import reexec_with_tcmalloc

        reexec_with_tcmalloc(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
