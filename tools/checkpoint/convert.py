"""``opd-convert`` from a checkout: ``python tools/checkpoint/convert.py hf-to-mcore|mcore-to-hf ...``.

The command lives in ``megatron_opd.checkpoint.convert`` (installed as ``opd-convert``); this file keeps the
checkout's path working, torchrun included (``torchrun --nproc-per-node 8 tools/checkpoint/convert.py ...``).
"""

from megatron_opd.checkpoint.convert import build_parser, main, parse_size, peak_rss_bytes, positive_int

__all__ = ["build_parser", "main", "parse_size", "peak_rss_bytes", "positive_int"]

if __name__ == "__main__":
    from megatron_opd.process_exit import exit_now

    exit_now(main())
