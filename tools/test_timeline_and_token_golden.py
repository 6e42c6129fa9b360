#!/usr/bin/env python3
"""Tests of tools/step_timeline.py and tools/token_golden.py (standard library only):

    python3 tools/test_timeline_and_token_golden.py -v
"""

import contextlib
import io
import json
import os
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_timeline  # noqa: E402
import token_golden  # noqa: E402

# Lines as the host's tracing writes them, colours included, and one that is
# not a forward.
LOG = (
    "\x1b[2m2026-12-03T07:11:44.000000Z\x1b[0m \x1b[34mDEBUG\x1b[0m \x1b[2mberrylm::host\x1b[0m: "
    "berrylm forward: 64 sequences x 128 tokens at positions [0, 0], recurrent slots in use 64\n"
    "2026-12-03T07:11:44.100000Z  INFO mistralrs_core::engine::logger: Throughput (T/s) 10.0\n"
    "\x1b[2m2026-12-03T07:11:44.250000Z\x1b[0m DEBUG berrylm::host: berrylm forward: "
    "64 sequences x 1 tokens at positions [128, 128], recurrent slots in use 64\n"
    "2026-12-03T07:11:44.271000Z DEBUG berrylm::host: berrylm forward: 40 sequences x 1 tokens "
    "at positions [129], recurrent slots in use 40\n"
    "2026-12-03T07:11:44.331000Z DEBUG berrylm::host: berrylm forward: 40 sequences x 1 tokens "
    "at positions [130], recurrent slots in use 40\n"
)


class StepTimelineTest(unittest.TestCase):
    def write_log(self, text):
        handle = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        handle.write(text)
        handle.close()
        self.addCleanup(os.unlink, handle.name)
        return handle.name

    def test_forwards_are_read_with_their_sizes_and_starts(self):
        steps = step_timeline.forwards(self.write_log(LOG))
        self.assertEqual([(rows, tokens) for _, rows, tokens in steps],
                         [(64, 128), (64, 1), (40, 1), (40, 1)])
        starts = [round((start - steps[0][0]) * 1e3, 3) for start, _, _ in steps]
        self.assertEqual(starts, [0.0, 250.0, 271.0, 331.0])

    def test_summary_counts_steps_and_lists_the_long_ones(self):
        path = self.write_log(LOG)
        out = io.StringIO()
        argv = sys.argv
        sys.argv = ["step_timeline.py", "--long-ms", "40", path]
        try:
            with contextlib.redirect_stdout(out):
                step_timeline.main()
        finally:
            sys.argv = argv
        text = out.getvalue()
        self.assertIn("4 forwards over 0.33 s", text)
        self.assertIn("decode steps by sequences: 40: 2, 64: 1", text)
        self.assertIn("prompt steps (sequences x tokens): 1: [(64, 128)]", text)
        # The prompt step was followed by 250 ms, the second 40-sequence step by 60 ms.
        long_steps = [line.split() for line in text.splitlines()[-2:]]
        self.assertEqual(long_steps, [["0.0", "64", "128", "250.0"], ["271.0", "40", "1", "60.0"]])

    def test_a_log_without_forwards_is_refused(self):
        path = self.write_log("2026-12-03T07:11:44.000000Z INFO nothing\n")
        argv = sys.argv
        sys.argv = ["step_timeline.py", path]
        try:
            with self.assertRaises(SystemExit) as refused:
                step_timeline.main()
        finally:
            sys.argv = argv
        self.assertIn("fewer than two", str(refused.exception))


def read_safetensors(path):
    """name -> (dtype, shape, bytes), read by the format's definition."""
    with open(path, "rb") as handle:
        data = handle.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    tensors, covered = {}, 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        start, end = entry["data_offsets"]
        assert start == covered, f"{name} does not follow the tensor before it"
        covered = end
        tensors[name] = (entry["dtype"], entry["shape"], body[start:end])
    assert covered == len(body), "the tensors do not cover the data"
    return tensors


class TokenGoldenTest(unittest.TestCase):
    def write(self, *args):
        handle = tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False)
        handle.close()
        self.addCleanup(os.unlink, handle.name)
        argv = sys.argv
        sys.argv = ["token_golden.py", "--out", handle.name, *args]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                token_golden.main()
        finally:
            sys.argv = argv
        return read_safetensors(handle.name)

    def test_sequences_of_ids_below_the_vocabulary_with_placeholder_logits(self):
        tensors = self.write("--vocab", "50", "--sequences", "2", "--tokens", "7")
        self.assertEqual(sorted(tensors), ["gen.output_ids", "gen.prompt_ids", "seq0.input_ids",
                                           "seq0.logits_f32", "seq1.input_ids", "seq1.logits_f32"])
        for i in range(2):
            dtype, shape, data = tensors[f"seq{i}.input_ids"]
            self.assertEqual((dtype, shape), ("I64", [7]))
            ids = struct.unpack("<7q", data)
            self.assertTrue(all(0 <= token < 50 for token in ids), ids)
            dtype, shape, data = tensors[f"seq{i}.logits_f32"]
            self.assertEqual((dtype, shape), ("F32", [7, 1]))
            self.assertEqual(struct.unpack("<7f", data), (0.0,) * 7)
        self.assertEqual(tensors["gen.prompt_ids"][1], [8])
        self.assertEqual(tensors["gen.output_ids"][1], [16])

    def test_the_seed_decides_the_ids(self):
        first = self.write("--vocab", "1000", "--seed", "3")
        again = self.write("--vocab", "1000", "--seed", "3")
        other = self.write("--vocab", "1000", "--seed", "4")
        self.assertEqual(first, again)
        self.assertNotEqual(first["seq0.input_ids"], other["seq0.input_ids"])


if __name__ == "__main__":
    unittest.main()
