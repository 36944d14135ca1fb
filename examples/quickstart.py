"""The quick start from a checkout: ``python examples/quickstart.py [--nproc 1] [--cross-tokenizer] ...``.

The command lives in ``megatron_opd.quickstart`` (installed as ``opd-quickstart``; its recipes are
``examples/quickstart/*.yaml``, packaged into the wheel); ``--help`` lists every option.
"""

from megatron_opd.quickstart import main

if __name__ == "__main__":
    main()
