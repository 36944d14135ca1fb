"""Imported first by ``run_distributed``'s rank server: the library warnings ``megatron_opd.quiet`` knows to be
harmless are silenced there once, so importing Megatron-Core in the server does not print them (forked ranks
inherit the filters)."""

from megatron_opd.quiet import silence_harmless_warnings

silence_harmless_warnings()
