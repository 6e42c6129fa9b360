#!/usr/bin/env python3
"""Writes a golden file of token ids for a checkpoint that has no reference
outputs (the random-weight BerryLM-OS-shaped checkpoints of berrylm-bench).

`berrylm-align --write-golden OUT` takes the sequences of its `--golden` and
writes our own logits for them; this file only supplies the positions:
`seq{i}.input_ids` (seeded random ids below `--vocab`), placeholder
`seq{i}.logits_f32` of one zero column (the run that writes the real golden
compares against them; its report is not read), and a short `gen.prompt_ids`
/ `gen.output_ids` pair for the greedy run. Standard library only (the
safetensors layout: a little-endian u64 header length, a JSON header, the
raw tensors).
"""

import argparse
import json
import random
import struct


def tensor_entry(dtype, shape, data, offset):
    """The header entry of `data` (bytes) at `offset`, and the next offset."""
    end = offset + len(data)
    return {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}, end


def write_safetensors(path, tensors):
    """`tensors`: name -> (dtype, shape, bytes), written in name order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name], offset = tensor_entry(dtype, shape, data, offset)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for blob in blobs:
            out.write(blob)


def ids_tensor(ids):
    return ("I64", [len(ids)], struct.pack(f"<{len(ids)}q", *ids))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the golden file to write")
    parser.add_argument("--vocab", type=int, required=True, help="ids are below this")
    parser.add_argument("--sequences", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1000, help="ids per sequence")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.vocab < 1 or args.sequences < 1 or args.tokens < 1:
        parser.error("--vocab, --sequences and --tokens must be positive")

    rng = random.Random(args.seed)
    draw = lambda count: [rng.randrange(args.vocab) for _ in range(count)]
    tensors = {}
    for i in range(args.sequences):
        tensors[f"seq{i}.input_ids"] = ids_tensor(draw(args.tokens))
        zeros = struct.pack(f"<{args.tokens}f", *([0.0] * args.tokens))
        tensors[f"seq{i}.logits_f32"] = ("F32", [args.tokens, 1], zeros)
    tensors["gen.prompt_ids"] = ids_tensor(draw(8))
    tensors["gen.output_ids"] = ids_tensor(draw(16))
    write_safetensors(args.out, tensors)
    print(f"{args.out}: {args.sequences} sequences of {args.tokens} ids below {args.vocab}")


if __name__ == "__main__":
    main()
