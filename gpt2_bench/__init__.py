"""GPT-2 over an emulated slow link: the benchmark that times and trains the codecs (docs/results.md)."""
