"""`python -m flexevict.convert`: write a model's weights in the engine's on-disk layout
(config.json + one memory-mappable .npy per tensor + tokenizer.json), read back with `--model DIR`.

    python -m flexevict.convert --model smollm2-135m --out ~/weights/smollm2-135m-np
"""
from __future__ import annotations

import argparse
import sys

from flexevict.api import resolve_model
from flexevict.errors import cli_errors
from flexevict.io.tokenizer import ByteTokenizer, load_tokenizer
from flexevict.io.weights import convert, open_weights


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexevict.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="registry name, HF folder or .gguf file")
    p.add_argument("--path", default=None, help="weights for a registry name (as in generate)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    args = p.parse_args(argv)
    with cli_errors("flexevict.convert"):
        config, path = resolve_model(args.model, args.path)
        tokenizer = load_tokenizer(path)
        convert(open_weights(path, config), config, args.out, args.dtype,
                tokenizer="bytes" if isinstance(tokenizer, ByteTokenizer) else "tokenizer.json")
        tokenizer.save(args.out)
        print(f"wrote {config.name} ({config.num_params() / 1e6:.1f}M parameters, {args.dtype}) "
              f"to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
