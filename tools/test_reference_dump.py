#!/usr/bin/env python3
"""Tests of tools/reference_dump.py on a tiny random Llama and a word-level tokenizer built here.

Run (torch, transformers, safetensors and tokenizers in the interpreter; skipped, with the reason,
when one of them is missing):

    ~/.cache/berrylm/venv-reference/bin/python tools/test_reference_dump.py -v

(`cargo xtask test` runs them with the venv it keeps in ~/.cache/berrylm/venv-reference-tests.)

The dumper runs as a subprocess, as a user runs it; every expectation is computed here
independently: the golden file's header is parsed by hand, the logits and hidden states come
from a fresh load of the saved checkpoint, and the greedy continuation from a cached decoding
loop (the dumper recomputes every step without cache).

Corpus mode (`CorpusModeTest`): windows re-derived here from the corpus's token ids (deterministic,
inside one document, exactly P tokens); the free-running continuation against a cached loop and
a from-scratch loop; the teacher-forced logits against fresh forwards; batch 3 against batch 1
(float32 within 1e-4; on a GPU too, where torch sees one); the file's names, dtypes, shapes and
metadata against the layout of the vendored `trained-tiny-corpus` reference, and the vendored
windows re-derived from its corpus with the trained-tiny tokenizer (`VendoredWindowsTest`; both
look for it in tests/fixtures/trained-tiny-corpus, then ../shared/golden/trained-tiny-corpus).
"""

import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DUMPER = os.path.join(HERE, "reference_dump.py")

MISSING = []
try:
    import torch
except ImportError:
    MISSING.append("torch")
try:
    import transformers
except ImportError:
    MISSING.append("transformers")
try:
    import safetensors  # noqa: F401 - the dumper writes with it
except ImportError:
    MISSING.append("safetensors")
try:
    import tokenizers
except ImportError:
    MISSING.append("tokenizers")
SKIP_REASON = (
    "cannot import " + ", ".join(MISSING) + ": install torch, transformers, safetensors and tokenizers "
    "(e.g. in ~/.cache/berrylm/venv-reference) to run these tests"
)

VOCAB = 64
HIDDEN = 32
LAYERS = 2
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "user", "assistant", "system", "tools:", "nothink", "hello", "world", "what", "is", "the",
    "weather", "in", "oslo", "?", "one", "two", "three", "plus", "get_weather", "get_time", "time",
]
# Whitespace-separated rendering, so the word-level tokenizer sees every piece.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_start|> system tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|> {% endif -%}"
    "{%- for m in messages -%}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|> assistant "
    "{%- if enable_thinking is defined and not enable_thinking %} nothink{% endif %} {% endif -%}"
)
PROMPTS = ["hello world", "what is the weather in oslo ?", "one"]
GEN_TOKENS = 6
CHAT = [
    {"messages": [{"role": "user", "content": "what is one plus two ?"}]},
    {
        "messages": [{"role": "user", "content": "what is the weather in oslo ?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
        ],
        "enable_thinking": False,
    },
]
IDS = ["5, 6,7", "9"]


def read_header(path):
    """The safetensors header, parsed by hand: {name: (dtype, shape)}."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], entry["shape"]) for name, entry in header.items()}


def load_tensors(path):
    from safetensors.torch import load_file

    return load_file(path)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names = SPECIALS + WORDS
    names += [f"w{i}" for i in range(VOCAB - len(names))]
    backend = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIALS)
    # Llama-style: the tokenizer prepends BOS by default.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def load_model(model_dir, dtype):
    from transformers import LlamaForCausalLM

    # `dtype=` since transformers 4.56, `torch_dtype=` before.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    keyword = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager", **{keyword: dtype})
    model.eval()
    return model


def cached_greedy(model, prompt, steps):
    """Greedy decoding through the model's KV cache: (new ids, logits of each step [steps, vocab])."""
    # transformers renamed `past_key_values` to `cache` (argument and output) in 5.x.
    new_name = "cache" in inspect.signature(model.forward).parameters
    rows = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        generated = []
        for _ in range(steps):
            last = out.logits[0, -1].float()
            rows.append(last)
            token = int(last.argmax())
            generated.append(token)
            if new_name:
                out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
            else:
                out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated, torch.stack(rows)


def run_dumper(args):
    result = subprocess.run(
        [sys.executable, DUMPER] + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(f"reference_dump.py {' '.join(args)} exited {result.returncode}:\n{result.stdout}")
    return result.stdout


def tiny_llama():
    """The tests' tiny random Llama (float32, in memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,  # logits of a few units, so bfloat16 rounding shows
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@unittest.skipIf(MISSING, SKIP_REASON)
class ReferenceDumpTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="berrylm-reference-dump-")
        cls.model_dir = os.path.join(cls.tmp, "tiny-llama", "model")
        model = tiny_llama()
        cls.tokenizer = build_tokenizer()
        # Make the token that greedy decoding emits second the EOS of the checkpoint, so a
        # dumper that stopped at EOS would be caught.
        prompt = cls.tokenizer(PROMPTS[0])["input_ids"]
        continuation, _ = cached_greedy(model, prompt, 2)
        cls.eos = continuation[1]
        model.config.eos_token_id = cls.eos
        model.generation_config.eos_token_id = cls.eos
        model.save_pretrained(cls.model_dir)
        cls.tokenizer.save_pretrained(cls.model_dir)
        del model

        cls.out_prompts = os.path.join(cls.tmp, "out-prompts")
        args = ["--model", cls.model_dir, "--out", cls.out_prompts, "--gen-tokens", str(GEN_TOKENS), "--hidden-states"]
        for text in PROMPTS:
            args += ["--prompt", text]
        cls.log_prompts = run_dumper(args)

        chat_file = os.path.join(cls.tmp, "chat.json")
        with open(chat_file, "w", encoding="utf-8") as handle:
            json.dump(CHAT, handle)
        cls.out_chat = os.path.join(cls.tmp, "out-chat")
        run_dumper(["--model", cls.model_dir, "--out", cls.out_chat, "--chat", chat_file, "--gen-tokens", "4",
                    "--gen-prompt", "1", "--no-bf16"])

        cls.out_ids = os.path.join(cls.tmp, "out-ids")
        args = ["--model", cls.model_dir, "--out", cls.out_ids, "--gen-tokens", "3", "--no-bf16"]
        for ids in IDS:
            args += ["--ids", ids]
        run_dumper(args)

        cls.out_cast = os.path.join(cls.tmp, "out-cast")
        args = ["--model", cls.model_dir, "--out", cls.out_cast, "--gen-tokens", "1", "--bf16-cast-buffers"]
        for text in PROMPTS:
            args += ["--prompt", text]
        run_dumper(args)

        cls.fresh = load_model(cls.model_dir, torch.float32)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def golden(self, out):
        with open(os.path.join(out, "golden.json"), encoding="utf-8") as handle:
            return json.load(handle)

    def test_tensor_names_dtypes_and_shapes_follow_the_golden_format(self):
        header = read_header(os.path.join(self.out_prompts, "golden.safetensors"))
        expected = {}
        for i, text in enumerate(PROMPTS):
            length = 1 + len(text.split())  # BOS + one token per word
            expected[f"seq{i}.input_ids"] = ("I64", [length])
            expected[f"seq{i}.logits_f32"] = ("F32", [length, VOCAB])
            expected[f"seq{i}.logits_bf16"] = ("F32", [length, VOCAB])
            expected[f"seq{i}.hidden_states_f32"] = ("F32", [LAYERS + 1, length, HIDDEN])
        prompt_len = 1 + len(PROMPTS[0].split())
        expected["gen.prompt_ids"] = ("I64", [prompt_len])
        expected["gen.output_ids"] = ("I64", [GEN_TOKENS])
        expected["gen.step_logits_f32"] = ("F32", [GEN_TOKENS, VOCAB])
        self.assertEqual(header, expected)

        header = read_header(os.path.join(self.out_chat, "golden.safetensors"))
        self.assertEqual(sorted(header), sorted(
            [f"seq{i}.{kind}" for i in range(len(CHAT)) for kind in ("input_ids", "logits_f32")]
            + ["gen.prompt_ids", "gen.output_ids", "gen.step_logits_f32"]
        ))
        self.assertEqual(header["gen.output_ids"], ("I64", [4]))

    def test_text_prompts_get_the_tokenizers_default_bos_and_nothing_else(self):
        tensors = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        golden = self.golden(self.out_prompts)
        for i, text in enumerate(PROMPTS):
            words = self.tokenizer.convert_tokens_to_ids(text.split())
            self.assertEqual(tensors[f"seq{i}.input_ids"].tolist(), [1] + words)
            self.assertEqual(golden["sequences"][i]["prompt"], text)
            self.assertTrue(golden["sequences"][i]["bos_added"])
        self.assertEqual(tensors["gen.prompt_ids"].tolist(), tensors["seq0.input_ids"].tolist())

    def test_logits_and_hidden_states_equal_a_fresh_forward_of_the_saved_model(self):
        tensors = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        for i in range(len(PROMPTS)):
            ids = tensors[f"seq{i}.input_ids"]
            with torch.no_grad():
                out = self.fresh(input_ids=ids[None], use_cache=False, output_hidden_states=True)
            logits = out.logits[0].float()
            self.assertLessEqual(float((tensors[f"seq{i}.logits_f32"] - logits).abs().max()), 1e-5)
            self.assertGreater(float(logits.abs().max()), 0.5)  # not a degenerate model
            hidden = torch.stack([h[0] for h in out.hidden_states])
            self.assertLessEqual(float((tensors[f"seq{i}.hidden_states_f32"] - hidden).abs().max()), 1e-5)

    def test_greedy_run_equals_an_independent_cached_continuation_and_does_not_stop_at_eos(self):
        tensors = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        prompt = tensors["gen.prompt_ids"].tolist()
        expected, step_logits = cached_greedy(self.fresh, prompt, GEN_TOKENS)
        self.assertEqual(tensors["gen.output_ids"].tolist(), expected)
        self.assertEqual(expected[1], self.eos)  # EOS came second, and the run went on
        self.assertLessEqual(float((tensors["gen.step_logits_f32"] - step_logits).abs().max()), 1e-4)
        # Step 0 predicts from the prompt: the last row of the prompt's own logits.
        self.assertTrue(torch.equal(tensors["gen.step_logits_f32"][0], tensors["seq0.logits_f32"][-1]))

        tensors = load_tensors(os.path.join(self.out_chat, "golden.safetensors"))
        prompt = tensors["seq1.input_ids"].tolist()
        self.assertEqual(tensors["gen.prompt_ids"].tolist(), prompt)  # --gen-prompt 1
        expected, _ = cached_greedy(self.fresh, prompt, 4)
        self.assertEqual(tensors["gen.output_ids"].tolist(), expected)

    def test_bf16_logits_are_close_to_f32_but_not_identical(self):
        tensors = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        golden = self.golden(self.out_prompts)
        for i in range(len(PROMPTS)):
            f32 = tensors[f"seq{i}.logits_f32"]
            bf16 = tensors[f"seq{i}.logits_bf16"]
            diff = float((bf16 - f32).abs().max())
            self.assertGreater(diff, 0.0, f"seq{i}: bf16 logits identical to f32")
            self.assertLess(diff, 0.1 * float(f32.abs().max()), f"seq{i}: bf16 logits far from f32")
            facts = golden["sequences"][i]
            self.assertAlmostEqual(facts["bf16_vs_f32_max_abs_logit_diff"], diff, places=5)
            match = float((bf16.argmax(-1) == f32.argmax(-1)).float().mean())
            self.assertAlmostEqual(facts["bf16_vs_f32_argmax_match"], match, places=6)
        # The bf16 run is the model in bfloat16, not float32 logits rounded afterwards.
        rounded = tensors["seq1.logits_f32"].to(torch.bfloat16).float()
        self.assertFalse(torch.equal(rounded, tensors["seq1.logits_bf16"]))

    def test_bf16_run_is_the_model_as_loaded_or_cast_whole_with_bf16_cast_buffers(self):
        loaded = load_model(self.model_dir, torch.bfloat16)
        cast = load_model(self.model_dir, torch.float32).to(torch.bfloat16)
        plain = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        with_cast = load_tensors(os.path.join(self.out_cast, "golden.safetensors"))
        for i in range(len(PROMPTS)):
            ids = plain[f"seq{i}.input_ids"][None]
            with torch.no_grad():
                expected_loaded = loaded(input_ids=ids, use_cache=False).logits[0].float()
                expected_cast = cast(input_ids=ids, use_cache=False).logits[0].float()
            self.assertTrue(torch.equal(plain[f"seq{i}.logits_bf16"], expected_loaded), f"seq{i}")
            self.assertTrue(torch.equal(with_cast[f"seq{i}.logits_bf16"], expected_cast), f"seq{i}")
            self.assertTrue(torch.equal(with_cast[f"seq{i}.logits_f32"], plain[f"seq{i}.logits_f32"]), f"seq{i}")
        # The rotary frequencies round differently once cast: the longer prompt's later positions show it.
        self.assertFalse(torch.equal(with_cast["seq1.logits_bf16"], plain["seq1.logits_bf16"]))
        self.assertTrue(torch.equal(with_cast["seq1.logits_bf16"][:1], plain["seq1.logits_bf16"][:1]))
        self.assertIn("float32", self.golden(self.out_prompts)["reference"]["bf16_buffers"])
        self.assertIn("--bf16-cast-buffers", self.golden(self.out_cast)["reference"]["bf16_buffers"])

    def test_modeling_registers_an_architecture_the_installed_transformers_lacks(self):
        # A model package of a model type transformers does not know: Llama under another name.
        package = os.path.join(self.tmp, "modeling", "toyllama")
        os.makedirs(package)
        with open(os.path.join(package, "__init__.py"), "w", encoding="utf-8") as handle:
            handle.write("")
        with open(os.path.join(package, "configuration_toyllama.py"), "w", encoding="utf-8") as handle:
            handle.write("from ..llama.configuration_llama import LlamaConfig\n\n\n"
                         "class ToyLlamaConfig(LlamaConfig):\n    model_type = 'toyllama'\n")
        with open(os.path.join(package, "modeling_toyllama.py"), "w", encoding="utf-8") as handle:
            handle.write("from ..llama.modeling_llama import LlamaForCausalLM\n"
                         "from .configuration_toyllama import ToyLlamaConfig\n\n\n"
                         "class ToyLlamaForCausalLM(LlamaForCausalLM):\n    config_class = ToyLlamaConfig\n")
        model_dir = os.path.join(self.tmp, "toy", "model")
        shutil.copytree(self.model_dir, model_dir)
        config_path = os.path.join(model_dir, "config.json")
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
        config["model_type"] = "toyllama"
        config["architectures"] = ["ToyLlamaForCausalLM"]
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump(config, handle)

        out = os.path.join(self.tmp, "out-toy")
        args = ["--model", model_dir, "--out", out, "--gen-tokens", "1", "--no-bf16", "--ids", IDS[0]]
        unknown = subprocess.run([sys.executable, DUMPER] + args, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=600)
        self.assertEqual(unknown.returncode, 2, unknown.stdout)
        self.assertIn("--modeling DIR", unknown.stdout)
        self.assertNotIn("Traceback", unknown.stdout)
        run_dumper(args + ["--modeling", package])
        tensors = load_tensors(os.path.join(out, "golden.safetensors"))
        with torch.no_grad():
            expected = self.fresh(input_ids=tensors["seq0.input_ids"][None], use_cache=False).logits[0].float()
        self.assertTrue(torch.equal(tensors["seq0.logits_f32"], expected))
        reference = self.golden(out)["reference"]
        self.assertEqual(reference["implementation"], "huggingface/transformers ToyLlamaForCausalLM")
        self.assertEqual(reference["modeling"], package)

    def test_golden_json_has_the_facts_and_the_reference_block(self):
        golden = self.golden(self.out_prompts)
        tensors = load_tensors(os.path.join(self.out_prompts, "golden.safetensors"))
        self.assertEqual(golden["fixture"], "tiny-llama")
        with open(os.path.join(self.model_dir, "config.json"), encoding="utf-8") as handle:
            self.assertEqual(golden["config"], json.load(handle))
        reference = golden["reference"]
        self.assertEqual(reference["transformers_version"], transformers.__version__)
        self.assertEqual(reference["torch_version"], torch.__version__)
        self.assertEqual(reference["device"], "cpu")
        self.assertIn("float32", reference["dtype"])
        self.assertIn("bfloat16", reference["bf16_dtype"])
        self.assertEqual(reference["attn_implementation"], "eager")
        self.assertIn("LlamaForCausalLM", reference["implementation"])
        self.assertIn("hidden_states_layout", golden)
        self.assertEqual(len(golden["sequences"]), len(PROMPTS))
        for i, facts in enumerate(golden["sequences"]):
            logits = tensors[f"seq{i}.logits_f32"]
            self.assertEqual(facts["index"], i)
            self.assertEqual(facts["len"], logits.shape[0])
            self.assertAlmostEqual(facts["logits_abs_max_f32"], float(logits.abs().max()), places=5)
            top = logits.topk(2, dim=-1).values
            self.assertAlmostEqual(facts["min_top1_top2_gap_f32"], float((top[:, 0] - top[:, 1]).min()), places=5)
            # The model's own cache path agrees with the full forward at float32 rounding.
            self.assertIsNotNone(facts["reference_incremental_max_abs_dev"])
            self.assertLess(facts["reference_incremental_max_abs_dev"], 1e-4)
        generation = golden["generation"]
        self.assertEqual(generation["prompt"], "seq0")
        self.assertEqual(generation["prompt_len"], tensors["gen.prompt_ids"].shape[0])
        self.assertEqual(generation["new_tokens"], GEN_TOKENS)
        self.assertIn("no cache", generation["decoding"])
        self.assertEqual(generation["text"], self.tokenizer.decode(tensors["gen.output_ids"].tolist()))

    def test_chat_prompts_are_rendered_with_the_template_and_recorded(self):
        golden = self.golden(self.out_chat)
        tensors = load_tensors(os.path.join(self.out_chat, "golden.safetensors"))
        expected_prompts = [
            "<|im_start|> user what is one plus two ? <|im_end|> <|im_start|> assistant ",
            "<|im_start|> system tools: get_weather get_time <|im_end|> "
            "<|im_start|> user what is the weather in oslo ? <|im_end|> <|im_start|> assistant nothink ",
        ]
        for i, entry in enumerate(CHAT):
            facts = golden["sequences"][i]
            self.assertEqual(facts["rendered_prompt"], expected_prompts[i])
            self.assertEqual(facts["messages"], entry["messages"])
            self.assertEqual(facts["tools"], entry.get("tools", []))
            self.assertEqual(facts.get("enable_thinking"), entry.get("enable_thinking"))
            # Rendered text tokenized without special tokens: no BOS in front.
            ids = tensors[f"seq{i}.input_ids"].tolist()
            self.assertEqual(ids, self.tokenizer.convert_tokens_to_ids(expected_prompts[i].split()))
            self.assertNotEqual(ids[0], 1)
            self.assertIsInstance(facts["greedy_completion_text"], str)
            self.assertNotIn("bf16_vs_f32_argmax_match", facts)
        # The completion is transformers' generate: greedy, stopping at the checkpoint's EOS.
        with torch.no_grad():
            prompt = tensors["seq0.input_ids"]
            out = self.fresh.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                      max_new_tokens=4, do_sample=False, pad_token_id=self.eos)
        self.assertEqual(golden["sequences"][0]["greedy_completion_text"],
                         self.tokenizer.decode(out[0, prompt.shape[0]:].tolist()))
        self.assertIsNone(golden["reference"]["bf16_dtype"])

    def test_token_ids_are_taken_as_given(self):
        tensors = load_tensors(os.path.join(self.out_ids, "golden.safetensors"))
        golden = self.golden(self.out_ids)
        self.assertEqual(tensors["seq0.input_ids"].tolist(), [5, 6, 7])
        self.assertEqual(tensors["seq1.input_ids"].tolist(), [9])
        self.assertNotIn("seq2.input_ids", tensors)
        self.assertEqual(golden["sequences"][0]["input"], "ids")
        with torch.no_grad():
            logits = self.fresh(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False).logits[0]
        self.assertLessEqual(float((tensors["seq0.logits_f32"] - logits).abs().max()), 1e-5)
        self.assertEqual(tensors["gen.output_ids"].shape[0], 3)

    def test_bad_arguments_are_refused(self):
        for args in (
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1,2", "--gen-tokens", "0"],
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1,2", "--prompt", "hello"],
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1,999"],
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1", "--gen-prompt", "3"],
            ["--model", os.path.join(self.tmp, "nowhere"), "--out", os.path.join(self.tmp, "x"), "--ids", "1"],
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1", "--no-bf16",
             "--bf16-cast-buffers"],
            ["--model", self.model_dir, "--out", os.path.join(self.tmp, "x"), "--ids", "1",
             "--modeling", os.path.join(self.tmp, "nowhere")],
        ):
            result = subprocess.run([sys.executable, DUMPER] + args, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, timeout=600)
            self.assertEqual(result.returncode, 2, f"{args}: {result.stdout}")
            self.assertFalse(os.path.exists(os.path.join(self.tmp, "x", "golden.safetensors")))


TRAINED_TINY = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "trained-tiny")


@unittest.skipIf(MISSING, SKIP_REASON)
@unittest.skipUnless(os.path.isdir(TRAINED_TINY), f"no fixture at {TRAINED_TINY}")
class ChatRenderingTest(unittest.TestCase):
    def test_trained_tiny_chats_render_to_the_reference_prompts_and_ids(self):
        # The fixture's golden.json fed back as --chat input: the dumper's rendering and
        # tokenization give the reference pipeline's rendered prompts and input ids.
        sys.path.insert(0, HERE)
        import reference_dump

        golden_json = os.path.join(TRAINED_TINY, "golden.json")
        with open(golden_json, encoding="utf-8") as handle:
            golden = json.load(handle)
        tensors = load_tensors(os.path.join(TRAINED_TINY, "golden.safetensors"))
        tokenizer = reference_dump.load_tokenizer(transformers, os.path.join(TRAINED_TINY, "model"), False, True)
        entries = reference_dump.load_chat_entries(golden_json)
        self.assertEqual(len(entries), len(golden["sequences"]))
        for i, entry in enumerate(entries):
            rendered, ids = reference_dump.render_chat(tokenizer, entry)
            self.assertEqual(rendered, golden["sequences"][i]["rendered_prompt"], f"seq{i}")
            self.assertEqual(ids, tensors[f"seq{i}.input_ids"].tolist(), f"seq{i}")


# Corpus mode. Documents with disjoint token sets, so that a window crossing a document boundary would show;
# one document one token too short for a window, one of exactly one window.
CORPUS_P = 8
CORPUS_D = 5
CORPUS_N = 10
CORPUS_SEED = 7
CORPUS_DOCUMENTS = [  # (first id, last id, length)
    (5, 19, 30),
    (20, 29, CORPUS_P - 1),
    (30, 39, CORPUS_P),
    (40, 63, 20),
]
CORPUS_KEYS = ("ids", "greedy_f32", "greedy_f32_logits", "greedy_bf16", "greedy_bf16_logits",
               "teacher_f32_logits", "teacher_bf16_logits")
VENDORED_GOLDEN_KEYS = ["num_prompts", "prompt_length", "decode_length", "seed", "corpus", "windows"]
REPO = os.path.dirname(HERE)
VENDORED_CORPUS = [
    path
    for path in (
        os.path.join(REPO, "tests", "fixtures", "trained-tiny-corpus"),
        os.path.join(os.path.dirname(REPO), "shared", "golden", "trained-tiny-corpus"),
    )
    if os.path.isfile(os.path.join(path, "golden.safetensors"))
]


def read_metadata(path):
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)).get("__metadata__")


def corpus_token_ids():
    """The test corpus as token ids (what the word-level tokenizer gives, computed without it)."""
    import random

    rng = random.Random(99)
    return [[rng.randint(low, high) for _ in range(length)] for low, high, length in CORPUS_DOCUMENTS]


def token_names():
    names = SPECIALS + WORDS
    return names + [f"w{i}" for i in range(VOCAB - len(names))]


def symbolic_layout(path, prompt_length, decode_length, vocab):
    """{(name with the prompt index as {i}, dtype, shape in P/D/P+D/V)}: the layout of a corpus file, whatever its
    sizes."""
    symbols = {prompt_length: "P", decode_length: "D", prompt_length + decode_length: "P+D", vocab: "V"}
    assert len(symbols) == 4, "the sizes must be distinct for the symbolic comparison"
    layout = set()
    for name, (dtype, shape) in read_header(path).items():
        prompt, _, key = name.partition(".")
        assert prompt.startswith("prompt") and prompt[6:].isdigit(), name
        layout.add(("prompt{i}." + key, dtype, tuple(symbols.get(n, n) for n in shape)))
    return layout


def from_scratch_greedy(model, prompt, steps):
    """Greedy decoding recomputing a full forward (no cache) at every step."""
    ids = list(prompt)
    rows = []
    with torch.no_grad():
        for _ in range(steps):
            last = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            rows.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt):], torch.stack(rows)


@unittest.skipIf(MISSING, SKIP_REASON)
class CorpusModeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, HERE)
        import reference_dump

        cls.dump = reference_dump
        cls.tmp = tempfile.mkdtemp(prefix="berrylm-reference-dump-corpus-")
        cls.model_dir = os.path.join(cls.tmp, "tiny-llama", "model")
        model = tiny_llama()
        model.save_pretrained(cls.model_dir)
        build_tokenizer().save_pretrained(cls.model_dir)
        del model
        cls.documents = corpus_token_ids()
        names = token_names()
        cls.texts = [" ".join(names[i] for i in ids) for ids in cls.documents]
        cls.corpus = os.path.join(cls.tmp, "corpus.jsonl")
        with open(cls.corpus, "w", encoding="utf-8") as handle:
            for i, text in enumerate(cls.texts):
                handle.write(json.dumps({"text": text}) + "\n")
                if i == 1:
                    handle.write("\n")  # blank lines are skipped
        cls.outs = {}
        for name, extra in (("b1", ["--batch-size", "1"]),
                            ("b3", ["--batch-size", "3"]),  # batches of 3, 3, 3 and 1
                            ("recompute", ["--batch-size", "4", "--greedy", "recompute"])):
            out = os.path.join(cls.tmp, f"out-{name}")
            run_dumper(cls.corpus_args(out) + extra)
            cls.outs[name] = out
        cls.tensors = {name: load_tensors(os.path.join(out, "golden.safetensors")) for name, out in cls.outs.items()}
        cls.f32 = load_model(cls.model_dir, torch.float32)
        cls.bf16 = load_model(cls.model_dir, torch.bfloat16)

    @classmethod
    def corpus_args(cls, out, seed=CORPUS_SEED, num_prompts=CORPUS_N):
        return ["--model", cls.model_dir, "--out", out, "--corpus", cls.corpus, "--num-prompts", str(num_prompts),
                "--prompt-length", str(CORPUS_P), "--decode-length", str(CORPUS_D), "--seed", str(seed)]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def golden(self, name="b1"):
        with open(os.path.join(self.outs[name], "golden.json"), encoding="utf-8") as handle:
            return json.load(handle)

    def test_windows_follow_the_sampling_rule(self):
        import random

        # Every start where P tokens fit inside one document, documents in order; random.Random(seed).sample.
        candidates = []
        for d, ids in enumerate(self.documents):
            candidates += [(d, start) for start in range(len(ids) - CORPUS_P + 1)]
        self.assertEqual(len(candidates), 23 + 0 + 1 + 13)
        drawn = random.Random(CORPUS_SEED).sample(candidates, CORPUS_N)
        tensors = self.tensors["b1"]
        golden = self.golden()
        for i, (d, start) in enumerate(drawn):
            window = self.documents[d][start:start + CORPUS_P]
            self.assertEqual(tensors[f"prompt{i}.ids"].tolist(), window, f"prompt{i}")
            self.assertEqual(golden["window_positions"][i], {"document": d, "start": start})
            self.assertEqual(golden["windows"][i], " ".join(token_names()[t] for t in window))
        self.assertNotIn(f"prompt{CORPUS_N}.ids", tensors)
        self.assertEqual(self.dump.sample_windows(self.documents, CORPUS_P, CORPUS_N, CORPUS_SEED), drawn)

    def test_windows_are_deterministic_within_one_document_and_exactly_p_tokens(self):
        for i in range(CORPUS_N):
            ids = self.tensors["b1"][f"prompt{i}.ids"].tolist()
            # The same windows on every run, whatever the batch size or the decoding.
            for name in ("b3", "recompute"):
                self.assertEqual(self.tensors[name][f"prompt{i}.ids"].tolist(), ids, f"{name} prompt{i}")
            self.assertEqual(len(ids), CORPUS_P)
            owners = [d for d, (low, high, _) in enumerate(CORPUS_DOCUMENTS) if all(low <= t <= high for t in ids)]
            self.assertEqual(len(owners), 1, f"prompt{i} {ids} mixes documents")
            document = self.documents[owners[0]]
            self.assertTrue(any(document[s:s + CORPUS_P] == ids for s in range(len(document) - CORPUS_P + 1)))
            self.assertNotEqual(owners[0], 1)  # one token too short: no window
        # The sampler alone: deterministic, seed-dependent, edges of documents included, refusing too many.
        sample = self.dump.sample_windows
        self.assertEqual(sample(self.documents, CORPUS_P, 37, 3), sample(self.documents, CORPUS_P, 37, 3))
        self.assertNotEqual(sample(self.documents, CORPUS_P, CORPUS_N, 1), sample(self.documents, CORPUS_P, CORPUS_N, 2))
        everything = set(sample(self.documents, CORPUS_P, 37, 0))
        self.assertIn((2, 0), everything)  # the document of exactly P tokens
        self.assertIn((3, 12), everything)  # the last start of a document
        self.assertNotIn((3, 13), everything)
        with self.assertRaises(ValueError):
            sample(self.documents, CORPUS_P, 38, 0)
        self.assertEqual(sorted(sample([[1] * 5, [2] * 3], 4, 2, 0)), [(0, 0), (0, 1)])

    def test_free_running_greedy_equals_a_cached_loop_and_a_from_scratch_loop(self):
        tensors = self.tensors["b1"]
        for i in range(CORPUS_N):
            prompt = tensors[f"prompt{i}.ids"].tolist()
            tokens = tensors[f"prompt{i}.greedy_f32"].tolist()
            logits = tensors[f"prompt{i}.greedy_f32_logits"]
            cached, cached_logits = cached_greedy(self.f32, prompt, CORPUS_D)
            scratch, scratch_logits = from_scratch_greedy(self.f32, prompt, CORPUS_D)
            self.assertEqual(tokens, cached, f"prompt{i}")
            self.assertEqual(tokens, scratch, f"prompt{i}")
            self.assertLessEqual(float((logits - cached_logits).abs().max()), 1e-5)
            self.assertLessEqual(float((logits - scratch_logits).abs().max()), 1e-4)
            self.assertTrue(torch.equal(logits.argmax(-1), tensors[f"prompt{i}.greedy_f32"]))
            # --greedy recompute (batched) gives the same continuation.
            other = self.tensors["recompute"]
            self.assertEqual(other[f"prompt{i}.greedy_f32"].tolist(), tokens)
            self.assertLessEqual(float((other[f"prompt{i}.greedy_f32_logits"] - scratch_logits).abs().max()), 1e-4)
            # bfloat16: the bf16 model's own cached continuation.
            bf16_tokens, bf16_logits = cached_greedy(self.bf16, prompt, CORPUS_D)
            self.assertEqual(tensors[f"prompt{i}.greedy_bf16"].tolist(), bf16_tokens, f"prompt{i}")
            self.assertLessEqual(float((tensors[f"prompt{i}.greedy_bf16_logits"] - bf16_logits).abs().max()), 1e-2)
        facts = self.golden()["reference"]
        self.assertLess(facts["greedy_f32_vs_teacher_f32_max_abs_logit_diff"], 1e-4)
        self.assertEqual(facts["greedy_f32_teacher_argmax_mismatches"], 0)
        self.assertIn("cached", facts["greedy"])
        self.assertIn("recompute", self.golden("recompute")["reference"]["greedy"])

    def test_teacher_logits_are_one_forward_over_the_window_and_the_f32_continuation(self):
        tensors = self.tensors["b1"]
        for i in range(CORPUS_N):
            sequence = torch.cat([tensors[f"prompt{i}.ids"], tensors[f"prompt{i}.greedy_f32"]])[None]
            with torch.no_grad():
                f32 = self.f32(input_ids=sequence, use_cache=False).logits[0].float()
                bf16 = self.bf16(input_ids=sequence, use_cache=False).logits[0].float()
            self.assertEqual(tuple(tensors[f"prompt{i}.teacher_f32_logits"].shape), (CORPUS_P + CORPUS_D, VOCAB))
            self.assertLessEqual(float((tensors[f"prompt{i}.teacher_f32_logits"] - f32).abs().max()), 1e-5)
            self.assertLessEqual(float((tensors[f"prompt{i}.teacher_bf16_logits"] - bf16).abs().max()), 1e-2)
            # Real bfloat16 computation, not float32 rounded.
            diff = float((tensors[f"prompt{i}.teacher_bf16_logits"] - f32).abs().max())
            self.assertGreater(diff, 0.0)
            self.assertLess(diff, 0.1 * float(f32.abs().max()))

    def test_f32_batch_is_within_1e_4_of_batch_1(self):
        one, three = self.tensors["b1"], self.tensors["b3"]
        self.assertEqual(sorted(one), sorted(three))
        for i in range(CORPUS_N):
            self.assertEqual(three[f"prompt{i}.greedy_f32"].tolist(), one[f"prompt{i}.greedy_f32"].tolist())
            for key in ("greedy_f32_logits", "teacher_f32_logits"):
                diff = float((three[f"prompt{i}.{key}"] - one[f"prompt{i}.{key}"]).abs().max())
                self.assertLessEqual(diff, 1e-4, f"prompt{i}.{key}")
            for key in CORPUS_KEYS:
                self.assertEqual(three[f"prompt{i}.{key}"].shape, one[f"prompt{i}.{key}"].shape)
        self.assertEqual(self.golden("b3")["reference"]["batch_size"], 3)

    def test_the_file_has_the_corpus_protocol_layout(self):
        path = os.path.join(self.outs["b1"], "golden.safetensors")
        expected = {}
        for i in range(CORPUS_N):
            expected[f"prompt{i}.ids"] = ("I64", [CORPUS_P])
            for dtype in ("f32", "bf16"):
                expected[f"prompt{i}.greedy_{dtype}"] = ("I64", [CORPUS_D])
                expected[f"prompt{i}.greedy_{dtype}_logits"] = ("F32", [CORPUS_D, VOCAB])
                expected[f"prompt{i}.teacher_{dtype}_logits"] = ("F32", [CORPUS_P + CORPUS_D, VOCAB])
        self.assertEqual(read_header(path), expected)
        self.assertEqual(read_metadata(path), {"num_prompts": str(CORPUS_N), "prompt_length": str(CORPUS_P),
                                               "seed": str(CORPUS_SEED), "decode_length": str(CORPUS_D)})
        golden = self.golden()
        self.assertEqual(list(golden)[:len(VENDORED_GOLDEN_KEYS)], VENDORED_GOLDEN_KEYS)
        self.assertEqual([golden[k] for k in VENDORED_GOLDEN_KEYS[:5]],
                         [CORPUS_N, CORPUS_P, CORPUS_D, CORPUS_SEED, "corpus.jsonl"])
        self.assertEqual(len(golden["windows"]), CORPUS_N)
        # The corpus travels with the reference, under the name golden.json gives.
        with open(self.corpus, "rb") as a, open(os.path.join(self.outs["b1"], golden["corpus"]), "rb") as b:
            self.assertEqual(a.read(), b.read())
        reference = golden["reference"]
        self.assertEqual(reference["transformers_version"], transformers.__version__)
        self.assertEqual(reference["device"], "cpu")
        self.assertEqual(reference["corpus_documents"], len(CORPUS_DOCUMENTS))
        self.assertEqual(reference["corpus_windows_available"], 37)
        self.assertIn("tokenizer.json", reference["tokenizer"])

    @unittest.skipUnless(VENDORED_CORPUS, "no trained-tiny-corpus at tests/fixtures/ or ../shared/golden/")
    def test_the_layout_equals_the_vendored_trained_tiny_corpus_file(self):
        vendored = VENDORED_CORPUS[0]
        with open(os.path.join(vendored, "golden.json"), encoding="utf-8") as handle:
            theirs = json.load(handle)
        ours = self.golden()
        their_file = os.path.join(vendored, "golden.safetensors")
        their_vocab = read_header(their_file)["prompt0.greedy_f32_logits"][1][1]
        self.assertEqual(
            symbolic_layout(os.path.join(self.outs["b1"], "golden.safetensors"), CORPUS_P, CORPUS_D, VOCAB),
            symbolic_layout(their_file, theirs["prompt_length"], theirs["decode_length"], their_vocab),
        )
        self.assertEqual(len(read_header(their_file)), len(CORPUS_KEYS) * theirs["num_prompts"])
        self.assertEqual(sorted(read_metadata(their_file)), sorted(read_metadata(
            os.path.join(self.outs["b1"], "golden.safetensors"))))
        self.assertEqual(list(theirs), VENDORED_GOLDEN_KEYS)
        for key in VENDORED_GOLDEN_KEYS:
            self.assertIs(type(ours[key]), type(theirs[key]), key)

    @unittest.skipUnless(not MISSING and torch.cuda.is_available(), "no CUDA device")
    def test_on_a_gpu_batched_f32_is_within_1e_4_of_batch_1_and_of_the_cpu(self):
        runs = {}
        for batch in (1, 4):
            out = os.path.join(self.tmp, f"out-cuda-b{batch}")
            run_dumper(self.corpus_args(out) + ["--device", "cuda", "--batch-size", str(batch)])
            runs[batch] = load_tensors(os.path.join(out, "golden.safetensors"))
            with open(os.path.join(out, "golden.json"), encoding="utf-8") as handle:
                self.assertEqual(json.load(handle)["reference"]["device"], "cuda")
        cpu = self.tensors["b1"]
        for i in range(CORPUS_N):
            for other in (runs[4], cpu):
                self.assertEqual(other[f"prompt{i}.ids"].tolist(), runs[1][f"prompt{i}.ids"].tolist())
                self.assertEqual(other[f"prompt{i}.greedy_f32"].tolist(), runs[1][f"prompt{i}.greedy_f32"].tolist())
                for key in ("greedy_f32_logits", "teacher_f32_logits"):
                    diff = float((other[f"prompt{i}.{key}"] - runs[1][f"prompt{i}.{key}"]).abs().max())
                    self.assertLessEqual(diff, 1e-4, f"prompt{i}.{key}")

    def test_bad_corpus_arguments_are_refused(self):
        bad_corpus = os.path.join(self.tmp, "bad.jsonl")
        with open(bad_corpus, "w", encoding="utf-8") as handle:
            handle.write('{"text": "hello"}\n{"txt": "world"}\n')
        x = os.path.join(self.tmp, "x")
        base = self.corpus_args(x)
        for args in (
            base[:-2],  # no --seed
            base + ["--gen-tokens", "3"],
            base + ["--hidden-states"],
            base + ["--batch-size", "0"],
            self.corpus_args(x, num_prompts=38),  # more windows than the corpus has
            [a if a != self.corpus else bad_corpus for a in base],
            ["--model", self.model_dir, "--out", x, "--ids", "1,2", "--num-prompts", "3"],
            ["--model", self.model_dir, "--out", x, "--ids", "1,2", "--corpus", self.corpus],
        ):
            result = subprocess.run([sys.executable, DUMPER] + args, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, timeout=600)
            self.assertEqual(result.returncode, 2, f"{args}: {result.stdout}")
            self.assertFalse(os.path.exists(os.path.join(x, "golden.safetensors")))


TRAINED_TINY_TOKENIZER = os.path.join(TRAINED_TINY, "model", "tokenizer.json")


@unittest.skipIf(MISSING, SKIP_REASON)
@unittest.skipUnless(VENDORED_CORPUS, "no trained-tiny-corpus at tests/fixtures/ or ../shared/golden/")
@unittest.skipUnless(os.path.isfile(TRAINED_TINY_TOKENIZER), f"no {TRAINED_TINY_TOKENIZER}")
class VendoredWindowsTest(unittest.TestCase):
    def test_the_sampler_reproduces_the_vendored_windows(self):
        # The acceptance of the sampling rule: the vendored reference's windows, re-derived from its corpus with
        # the trained-tiny tokenizer and the dumper's sampler, token for token and text for text.
        sys.path.insert(0, HERE)
        import reference_dump

        vendored = VENDORED_CORPUS[0]
        with open(os.path.join(vendored, "golden.json"), encoding="utf-8") as handle:
            golden = json.load(handle)
        tensors = load_tensors(os.path.join(vendored, "golden.safetensors"))
        tokenizer = reference_dump.CorpusTokenizer(os.path.join(TRAINED_TINY, "model"), False)
        self.assertIn("tokenizer.json", tokenizer.description)
        documents = tokenizer.encode(reference_dump.read_corpus(os.path.join(vendored, golden["corpus"])))
        positions = reference_dump.sample_windows(documents, golden["prompt_length"], golden["num_prompts"],
                                                  golden["seed"])
        for i, (d, start) in enumerate(positions):
            window = documents[d][start:start + golden["prompt_length"]]
            self.assertEqual(window, tensors[f"prompt{i}.ids"].tolist(), f"prompt{i}")
            self.assertEqual(tokenizer.decode(window), golden["windows"][i], f"prompt{i}")
        self.assertEqual(len(positions), golden["num_prompts"])


if __name__ == "__main__":
    unittest.main()
