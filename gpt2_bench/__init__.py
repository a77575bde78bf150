"""GPT-2 on OpenWebText over an emulated slow link (see issue: GPT-2 benchmark)."""
