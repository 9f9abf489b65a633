"""Reading models: `weights` (dummy, HF folders, native layout, the converter), `gguf_io`,
`tokenizer` and `packaged` (the models and texts that ship as pip packages).

May import `flexevict.core` and `flexevict.errors`."""
