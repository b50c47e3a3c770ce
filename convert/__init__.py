"""Conversion of the released HazyResearch JRT / Based checkpoints to HF folders (installed as `jrt_convert`)."""
