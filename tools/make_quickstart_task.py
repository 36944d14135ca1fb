"""The quick start's task maker from a checkout: ``python tools/make_quickstart_task.py OUT_DIR [...]``.

The command lives in ``megatron_opd.tasks.quickstart_task`` (``python -m megatron_opd.tasks.quickstart_task``).
"""

from megatron_opd.tasks.quickstart_task import main, make_quickstart_task

__all__ = ["main", "make_quickstart_task"]

if __name__ == "__main__":
    main()
