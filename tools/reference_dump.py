#!/usr/bin/env python3
"""Write a golden reference file for any local Hugging Face causal-LM checkpoint.

The output has the layout of the project's golden fixtures (tests/fixtures/GOLDEN.md), so that

    cargo xtask align --model DIR --golden OUT_DIR/golden.safetensors

compares the berrylm plugin with the transformers implementation on a real checkpoint (for
BerryLM-OS: a transformers that has `BerryLMForCausalLM`, or the checkpoint's own code with
`--trust-remote-code`).

Usage
-----

    python tools/reference_dump.py --model DIR --out OUT_DIR \\
        (--prompt TEXT [--prompt TEXT ...] | --ids "1,2,3" [--ids ...] | --chat FILE.json) \\
        [--device cpu|cuda] [--gen-tokens N] [--gen-prompt I] [--hidden-states] [--no-bf16] \\
        [--bos auto|always|never] [--no-completions] [--trust-remote-code] [--name NAME] \\
        [--modeling DIR] [--bf16-cast-buffers]

Examples:

    python tools/reference_dump.py --model ~/models/BerryLM-OS --out /tmp/berrylm-ref \\
        --prompt "The capital of France is" --prompt "def fibonacci(n):" --gen-tokens 32
    python tools/reference_dump.py --model ~/models/BerryLM-OS --out /tmp/berrylm-chat \\
        --chat tests/fixtures/trained-tiny/golden.json --device cuda

Inputs (one kind per run; each --prompt / --ids is one sequence `seq{i}`, in order):

* `--prompt TEXT`: tokenized with the checkpoint's tokenizer. No special tokens are added,
  except a leading BOS when the tokenizer itself prepends one by default (Llama-style tokenizers:
  `tokenizer(text)` starts with `bos_token_id`), because such a model is trained and served with
  it. `--bos never` / `--bos always` overrides that (`auto`, the default, is the rule above). The
  golden fixtures have no BOS; BerryLM's tokenizer adds none, so for BerryLM `auto` adds nothing.
* `--ids "1,2,3"`: token ids as given (no tokenizer needed).
* `--chat FILE.json`: a JSON list of `{"messages": [...], "tools": [...]?, "enable_thinking":
  bool?, "chat_template_kwargs": {...}?}` (or an object with such a list under `"sequences"`, so
  a fixture's golden.json can be fed back). Each is rendered with the tokenizer's chat template
  (`apply_chat_template(..., add_generation_prompt=True)`; `enable_thinking` is passed to the
  template only when the entry has it) and the rendered text is tokenized without adding special
  tokens (what transformers' `apply_chat_template(tokenize=True)` does). golden.json records the
  messages, tools, `enable_thinking`, the rendered prompt and, unless `--no-completions`, the
  reference's greedy completion text (transformers `generate`, float32, greedy, at most
  `--gen-tokens` new tokens, stopping at the checkpoint's EOS).

Outputs, in OUT_DIR:

* `golden.safetensors`:
  * `seq{i}.input_ids` i64 [T];
  * `seq{i}.logits_f32` f32 [T, vocab]: the model loaded in float32, eager attention when the
    model supports `attn_implementation="eager"` (else its default, recorded) and the model's own
    expert loop where it takes `experts_implementation="eager"` (recorded), one forward over
    the whole sequence without cache; TF32 is disabled on CUDA;
  * `seq{i}.hidden_states_f32` f32 [L+1, T, hidden] with `--hidden-states`
    (`output_hidden_states`, transformers' convention: embeddings first, last entry after the
    final norm);
  * `seq{i}.logits_bf16` f32 [T, vocab]: the same forward with the model loaded in bfloat16,
    logits cast to float32 (skipped with `--no-bf16`). `from_pretrained` keeps the rotary
    embedding's `inv_freq` buffer in float32; `--bf16-cast-buffers` casts it (and any other floating
    buffer) to bfloat16 as `model.to(torch.bfloat16)` does, which is how the vendored fixtures'
    `logits_bf16` were made (the rotary angles then round differently from the second position on);
  * `gen.prompt_ids`, `gen.output_ids` i64, `gen.step_logits_f32` f32 [N, vocab]: greedy
    decoding of N = `--gen-tokens` tokens from sequence `--gen-prompt` (default 0): at every step
    the float32 logits of the whole sequence so far are recomputed from scratch (no cache) and
    the argmax of the last position is appended; it does not stop at EOS.
* `golden.json`: `fixture`, `reference` (transformers and torch versions, device, dtypes,
  attention implementation, the command), `sequences` (per sequence: `index`, `len`, the input,
  `logits_abs_max_f32`, `min_top1_top2_gap_f32`, `reference_incremental_max_abs_dev` (prefill of
  the first max(1, T/2) tokens then one-token decode steps with the model's own cache, against
  the full forward; null when the model's cache path fails), `bf16_vs_f32_argmax_match`,
  `bf16_vs_f32_max_abs_logit_diff`), `generation` (prompt, lengths, decoding, smallest top-1/top-2
  gap along the run, text), `hidden_states_layout` with `--hidden-states`, and `config` (the
  checkpoint's config.json as stored).

Corpus mode
-----------

    python tools/reference_dump.py --model DIR --out OUT_DIR --corpus FILE.jsonl \
        --num-prompts N --prompt-length P --decode-length D --seed S \
        [--batch-size B] [--device cpu|cuda] [--greedy cached|recompute] [--trust-remote-code] \\
        [--modeling DIR] [--bf16-cast-buffers]

writes the corpus protocol's reference, in the layout of ../shared/golden/trained-tiny-corpus (its README):

* Windows: FILE has one JSON object `{"text": ...}` a line (a document each; blank lines skipped). Each
  document is tokenized with the checkpoint's `tokenizer.json` (the `tokenizers` package; transformers'
  AutoTokenizer when there is none), no special tokens. The candidates are every (document, start) where P
  tokens fit inside that document, documents in file order, starts ascending; N of them are drawn with
  `random.Random(S).sample`, window i being the i-th drawn. So every window is exactly P tokens of one
  document. (This reproduces the vendored trained-tiny-corpus windows exactly.)
* `golden.safetensors`, for each window i (metadata: `num_prompts`, `prompt_length`, `seed`,
  `decode_length`, as strings):
  * `prompt{i}.ids` i64 [P];
  * `prompt{i}.greedy_f32` i64 [D], `prompt{i}.greedy_f32_logits` f32 [D, vocab]: free-running greedy
    continuation of the model loaded in float32 (TF32 off), each token the argmax of the logits stored
    for it; it does not stop at EOS. `--greedy cached` (default): one forward over the window with the
    model's cache, then one token per step through the cache; `--greedy recompute`: a full forward
    without cache over the window and the tokens before it at every step (the vendored file's method;
    D times the cost). The tests check that both give the same tokens, and logits within 1e-4;
  * `prompt{i}.greedy_bf16`, `prompt{i}.greedy_bf16_logits`: the same with the model loaded in bfloat16
    (its own continuation; logits cast to float32);
  * `prompt{i}.teacher_f32_logits` f32 [P + D, vocab]: one forward without cache over the window followed
    by `greedy_f32`; `prompt{i}.teacher_bf16_logits`: the same sequence through the bfloat16 model.
* `golden.json`: `num_prompts`, `prompt_length`, `decode_length`, `seed`, `corpus` (the corpus file's
  name; it is copied into OUT_DIR), `windows` (each window's text), then what the vendored file lacks:
  `window_positions` (document index and start token of each window) and a `reference` block (versions,
  device, batch size, decoding, tokenizer, the command, and self-checks: the largest |diff| between the
  float32 greedy step logits and the teacher-forced rows predicting the same tokens, the count of those
  rows whose argmax is not the greedy token, the smallest top-1/top-2 gap of the greedy steps, and how
  many windows' bf16 continuation equals the f32 one).
* Batching (`--batch-size B`, on the CPU or a GPU): B windows per forward. Every window has exactly P
  tokens and every continuation exactly D, so a batch never needs padding (the attention mask is all
  ones) and batching changes only the rounding of the batched matrix products: the float32 logits stay
  within 1e-4 of batch 1 (tested).

Memory: the float32 model needs 4 bytes per parameter on the chosen device; the bfloat16 model is
loaded after the float32 one is released. In corpus mode every tensor is kept in host memory until the
file is written: about 4 * N * (P + 2 * D) * vocab * 2 bytes.

Needs torch, transformers and safetensors (tools/test_reference_dump.py tests this script on a
tiny Llama built on the spot).
"""

import argparse
import gc
import inspect
import json
import os
import platform
import shutil
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="checkpoint folder (config.json, weights, tokenizer)")
    parser.add_argument("--out", required=True, help="output folder (created)")
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeatable)")
    inputs.add_argument("--ids", action="append", metavar="IDS", help='comma-separated token ids, e.g. "1,2,3" (repeatable)')
    inputs.add_argument("--chat", metavar="FILE", help="JSON list of {messages, tools?, enable_thinking?}")
    inputs.add_argument("--corpus", metavar="FILE", help="corpus mode: JSON lines {\"text\": ...} to sample windows from")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--gen-tokens", type=int, metavar="N", help="greedy tokens to generate (default 16, at least 1)")
    parser.add_argument("--gen-prompt", type=int, metavar="I", help="index of the sequence the greedy run starts from (default 0)")
    parser.add_argument("--hidden-states", action="store_true", help="also store seq{i}.hidden_states_f32")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 run (no seq{i}.logits_bf16)")
    parser.add_argument("--bos", choices=["auto", "always", "never"],
                        help="leading BOS for --prompt: auto (default) = only when the tokenizer adds one by default")
    parser.add_argument("--no-completions", action="store_true", help="with --chat: do not record greedy completion texts")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modeling/tokenizer code")
    parser.add_argument("--modeling", metavar="DIR",
                        help="a transformers model package (e.g. transformers main's src/transformers/models/berrylm) "
                        "to import as transformers.models.<folder name> and register with the Auto classes, for a "
                        "transformers release that lacks the architecture")
    parser.add_argument("--bf16-cast-buffers", action="store_true",
                        help="bfloat16 run: also cast the model's floating buffers (the rotary inv_freq) to bfloat16, "
                        "as model.to(torch.bfloat16) does; from_pretrained keeps them in float32")
    parser.add_argument("--name", help="the `fixture` name in golden.json (default: the checkpoint folder's name)")
    corpus = parser.add_argument_group("corpus mode (with --corpus)")
    corpus.add_argument("--num-prompts", type=int, metavar="N", help="windows to sample (required)")
    corpus.add_argument("--prompt-length", type=int, metavar="P", help="tokens per window (required)")
    corpus.add_argument("--decode-length", type=int, metavar="D", help="greedy tokens after each window (required)")
    corpus.add_argument("--seed", type=int, metavar="S", help="seed of random.Random(S).sample (required)")
    corpus.add_argument("--batch-size", type=int, metavar="B", help="windows per forward (default 1)")
    corpus.add_argument("--greedy", choices=["cached", "recompute"],
                        help="free-running decoding: cached (default; the model's cache, one token per step) or "
                        "recompute (a full forward over the whole sequence at every step, no cache)")
    args = parser.parse_args(argv)
    if args.no_bf16 and args.bf16_cast_buffers:
        parser.error("--bf16-cast-buffers applies to the bfloat16 run, which --no-bf16 leaves out")
    corpus_options = ("num_prompts", "prompt_length", "decode_length", "seed", "batch_size", "greedy")
    sequence_options = ("gen_tokens", "gen_prompt", "bos", "name")
    if args.corpus:
        for name in sequence_options:
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} does not apply to --corpus")
        for name in ("hidden_states", "no_bf16", "no_completions"):
            if getattr(args, name):
                parser.error(f"--{name.replace('_', '-')} does not apply to --corpus (its format has every key)")
        for name in ("num_prompts", "prompt_length", "decode_length", "seed"):
            if getattr(args, name) is None:
                parser.error(f"--corpus needs --{name.replace('_', '-')}")
        if args.batch_size is None:
            args.batch_size = 1
        if args.greedy is None:
            args.greedy = "cached"
        for name in ("num_prompts", "prompt_length", "decode_length", "batch_size"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1")
    else:
        for name in corpus_options:
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} needs --corpus")
        if args.gen_tokens is None:
            args.gen_tokens = 16
        if args.gen_prompt is None:
            args.gen_prompt = 0
        if args.bos is None:
            args.bos = "auto"
        if args.gen_tokens < 1:
            parser.error("--gen-tokens must be at least 1 (the align tool needs gen.output_ids)")
    return args


def fail(message):
    print(f"reference_dump: error: {message}", file=sys.stderr)
    sys.exit(2)


def import_stack():
    missing = []
    modules = {}
    for name in ("torch", "transformers", "safetensors"):
        try:
            modules[name] = __import__(name)
        except ImportError as error:
            missing.append(f"{name} ({error})")
    if missing:
        fail("cannot import " + ", ".join(missing) + ": pip install torch transformers safetensors")
    return modules["torch"], modules["transformers"]


def fixture_name(model_dir):
    path = os.path.abspath(model_dir).rstrip(os.sep)
    base = os.path.basename(path)
    if base == "model":
        base = os.path.basename(os.path.dirname(path))
    return base


def read_json(path):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def parse_ids(text):
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        fail(f"--ids {text!r}: expected comma-separated integers")
    if not ids:
        fail(f"--ids {text!r}: no ids")
    if any(i < 0 for i in ids):
        fail(f"--ids {text!r}: negative id")
    return ids


def load_tokenizer(transformers, model_dir, trust_remote_code, required):
    try:
        return transformers.AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - any loading failure means "no tokenizer"
        if required:
            fail(f"cannot load the tokenizer of {model_dir}: {error}")
        print(f"reference_dump: no tokenizer ({type(error).__name__}: {error}); texts are not recorded", file=sys.stderr)
        return None


def encode_prompt(tokenizer, text, bos_policy):
    """Token ids of a text prompt and whether a BOS was prepended (see the module docstring)."""
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos_policy == "never" or bos is None:
        return plain, False
    if bos_policy == "always":
        return [bos] + plain, True
    default = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if default[:1] == [bos] and default[1:len(plain) + 1] == plain:
        return [bos] + plain, True
    return plain, False


def load_chat_entries(path):
    data = read_json(path)
    if isinstance(data, dict):
        data = data.get("sequences")
    if not isinstance(data, list) or not data:
        fail(f"--chat {path}: expected a non-empty JSON list (or an object with a `sequences` list)")
    entries = []
    for index, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("messages"), list):
            fail(f"--chat {path}: entry {index} has no `messages` list")
        entries.append(entry)
    return entries


def render_chat(tokenizer, entry):
    if not getattr(tokenizer, "chat_template", None):
        fail("--chat: the tokenizer has no chat template")
    kwargs = dict(entry.get("chat_template_kwargs") or {})
    if "enable_thinking" in entry:
        kwargs["enable_thinking"] = entry["enable_thinking"]
    tools = entry.get("tools") or None
    rendered = tokenizer.apply_chat_template(
        entry["messages"], tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return rendered, ids


def build_sequences(args, tokenizer):
    """[(ids, facts)] in order, facts being the input part of the sequence's golden.json entry."""
    sequences = []
    if args.ids:
        for text in args.ids:
            ids = parse_ids(text)
            facts = {"input": "ids"}
            if tokenizer is not None:
                facts["text"] = tokenizer.decode(ids, skip_special_tokens=False)
            sequences.append((ids, facts))
    elif args.prompt:
        for text in args.prompt:
            ids, bos_added = encode_prompt(tokenizer, text, args.bos)
            if not ids:
                fail(f"--prompt {text!r} tokenizes to nothing")
            sequences.append((ids, {"input": "prompt", "prompt": text, "bos_added": bos_added}))
    else:
        for entry in load_chat_entries(args.chat):
            rendered, ids = render_chat(tokenizer, entry)
            facts = {
                "input": "chat",
                "messages": entry["messages"],
                "tools": entry.get("tools") or [],
            }
            if "enable_thinking" in entry:
                facts["enable_thinking"] = entry["enable_thinking"]
            if entry.get("chat_template_kwargs"):
                facts["chat_template_kwargs"] = entry["chat_template_kwargs"]
            facts["rendered_prompt"] = rendered
            sequences.append((ids, facts))
    return sequences


def dtype_keyword(transformers):
    """`dtype=` since transformers 4.56, `torch_dtype=` before."""
    try:
        from packaging.version import Version

        return "dtype" if Version(transformers.__version__) >= Version("4.56.0") else "torch_dtype"
    except Exception:  # noqa: BLE001
        return "torch_dtype"


def load_model(torch, transformers, model_dir, dtype, device, args):
    """The checkpoint in `dtype`, with the eager attention and the eager experts (the modeling file's own loops)
    where the model takes them; with `--bf16-cast-buffers` a non-float32 model's floating buffers are cast too."""
    common = {dtype_keyword(transformers): dtype, "trust_remote_code": args.trust_remote_code}
    auto = transformers.AutoModelForCausalLM
    implementations = {"attn_implementation": "eager", "experts_implementation": "eager"}
    while True:
        try:
            model = auto.from_pretrained(model_dir, **implementations, **common)
            break
        except (ValueError, TypeError, NotImplementedError) as error:
            refused = refused_implementation(implementations, str(error))
            if refused is None:
                if unknown_architecture(str(error)):
                    fail(f"{model_dir}: transformers {transformers.__version__} has no model of this checkpoint's type "
                         f"({error}); give --modeling DIR (the model's package of a transformers that has it) or "
                         f"--trust-remote-code (the checkpoint's own code)")
                raise
            print(f"reference_dump: {refused}='eager' refused ({error}); using the model's default", file=sys.stderr)
            del implementations[refused]
    if args.bf16_cast_buffers and dtype != torch.float32:
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer is not None and buffer.is_floating_point():
                    setattr(module, name, buffer.to(dtype))
    model.to(device)
    model.eval()
    return model


def refused_implementation(implementations, message):
    """Which of the requested implementations a loading error refuses: the one it names, else the attention
    (older transformers name only "eager")."""
    for name in implementations:
        if name in message:
            return name
    if "eager" in message and "attn_implementation" in implementations:
        return "attn_implementation"
    return None


def unknown_architecture(message):
    """Whether a loading error says that transformers does not know the checkpoint's model type."""
    return any(text in message for text in (
        "does not recognize this architecture",
        "Unrecognized configuration class",
        "Unrecognized model",
    ))


def register_modeling(transformers, folder):
    """Imports the model package `folder` as transformers.models.<its name> and registers its configuration and
    causal-LM classes with the Auto classes (`--modeling`)."""
    import importlib
    import transformers.models

    folder = os.path.abspath(folder).rstrip(os.sep)
    name = os.path.basename(folder)
    if not os.path.isfile(os.path.join(folder, f"modeling_{name}.py")):
        fail(f"--modeling {folder}: no modeling_{name}.py there")
    if not os.path.isfile(os.path.join(folder, f"configuration_{name}.py")):
        fail(f"--modeling {folder}: no configuration_{name}.py there")
    parent = os.path.dirname(folder)
    if parent not in transformers.models.__path__:
        transformers.models.__path__.append(parent)
    configuration = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    configs = [c for c in vars(configuration).values()
               if isinstance(c, type) and issubclass(c, transformers.PretrainedConfig)
               and c.__module__ == configuration.__name__ and getattr(c, "model_type", "")]
    causal = [c for c in vars(modeling).values()
              if isinstance(c, type) and c.__name__.endswith("ForCausalLM") and c.__module__ == modeling.__name__]
    if len(configs) != 1 or len(causal) != 1:
        fail(f"--modeling {folder}: expected one configuration class with a model_type and one *ForCausalLM class, "
             f"found {[c.__name__ for c in configs]} and {[c.__name__ for c in causal]}")
    # exist_ok: the Auto mappings skip a class of a transformers.* module that is not theirs unless it is set.
    transformers.AutoConfig.register(configs[0].model_type, configs[0], exist_ok=True)
    transformers.AutoModelForCausalLM.register(configs[0], causal[0], exist_ok=True)
    print(f"reference_dump: registered {causal[0].__name__} ({configs[0].model_type}) from {folder}", file=sys.stderr)


def bf16_buffers(args):
    if args.bf16_cast_buffers:
        return "bfloat16 (--bf16-cast-buffers: the rotary inv_freq and every other floating buffer cast)"
    return "as from_pretrained leaves them (the rotary inv_freq in float32)"


def modeling_source(args):
    return os.path.abspath(args.modeling) if args.modeling else None


def implementation(model, kind):
    """The implementation the loaded model runs for `kind` ("attn" or "experts"), as its config records it."""
    config = model.config
    return getattr(config, f"_{kind}_implementation", None) or getattr(config, f"{kind}_implementation", None)


def forward(torch, model, ids, device, hidden_states=False):
    """Full-sequence forward without cache: (logits f32 [T, vocab] on CPU, hidden [L+1, T, H] or None)."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            use_cache=False,
            output_hidden_states=hidden_states,
            return_dict=True,
        )
    logits = out.logits[0].to(torch.float32).cpu().contiguous()
    hidden = None
    if hidden_states:
        hidden = torch.stack([h[0].to(torch.float32).cpu() for h in out.hidden_states]).contiguous()
    return logits, hidden


def cache_argument(model):
    """The forward's cache argument: `cache` in recent transformers, `past_key_values` before."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(out):
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("the model returned no cache with use_cache=True")


def incremental_deviation(torch, model, ids, full_logits, device):
    """Max |logit diff| of prefill(first max(1, T/2)) + one-token cached decode steps vs the full forward."""
    total = len(ids)
    prefill = max(1, total // 2)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    rows = []
    argument = cache_argument(model)
    try:
        with torch.no_grad():
            out = model(input_ids=x[:, :prefill], attention_mask=torch.ones_like(x[:, :prefill]), use_cache=True, return_dict=True)
            rows.append(out.logits[0].to(torch.float32).cpu())
            for t in range(prefill, total):
                out = model(
                    input_ids=x[:, t:t + 1],
                    attention_mask=torch.ones_like(x[:, :t + 1]),
                    use_cache=True,
                    return_dict=True,
                    **{argument: returned_cache(out)},
                )
                rows.append(out.logits[0].to(torch.float32).cpu())
    except Exception as error:  # noqa: BLE001 - a fact, not a requirement
        print(f"reference_dump: incremental check skipped ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    incremental = torch.cat(rows, dim=0)
    if incremental.shape != full_logits.shape:
        return None
    return float((incremental - full_logits).abs().max())


def min_top1_top2_gap(torch, logits):
    if logits.shape[-1] < 2:
        return None
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def greedy_no_cache(torch, model, prompt, steps, device):
    """Greedy argmax of float32 logits recomputed from scratch at every step; never stops at EOS."""
    ids = list(prompt)
    step_logits = []
    for _ in range(steps):
        logits, _ = forward(torch, model, ids, device)
        last = logits[-1].clone()
        step_logits.append(last)
        ids.append(int(torch.argmax(last)))
    return ids[len(prompt):], torch.stack(step_logits).contiguous()


def greedy_completion(torch, model, tokenizer, ids, max_new_tokens, device):
    """The reference's greedy completion text with transformers' generate (cache, stops at EOS)."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        eos = generation_config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            kwargs["pad_token_id"] = eos
    try:
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kwargs)
    except Exception as error:  # noqa: BLE001
        print(f"reference_dump: greedy completion skipped ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=False)


def device_description(torch, device):
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def setup_device(torch, device):
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            fail("--device cuda: torch sees no CUDA device")
        # float32 means float32: no TF32 in matmuls or convolutions.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif device != "cpu":
        fail(f"--device {device}: expected cpu or cuda[:N]")
    torch.set_float32_matmul_precision("highest")
    return device


def release(torch, device):
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# Corpus mode (the corpus protocol of ../shared/golden/trained-tiny-corpus, see its README and the module docstring).
# The sampling functions use the standard library only, so tests can import them without torch.


def read_corpus(path):
    """The documents of a JSON-lines corpus: one object `{"text": str}` a line (blank lines skipped)."""
    documents = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        fail(f"--corpus {path}: {error}")
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as error:
                fail(f"--corpus {path}:{number}: not JSON ({error})")
            if not isinstance(entry, dict) or not isinstance(entry.get("text"), str):
                fail(f"--corpus {path}:{number}: expected an object with a string `text`")
            documents.append(entry["text"])
    if not documents:
        fail(f"--corpus {path}: no documents")
    return documents


def window_candidates(documents, prompt_length):
    """Every (document, start) where `prompt_length` tokens fit inside that document, in document then start order."""
    return [
        (index, start)
        for index, ids in enumerate(documents)
        for start in range(len(ids) - prompt_length + 1)
    ]


def sample_windows(documents, prompt_length, num_prompts, seed):
    """The corpus protocol's windows: `num_prompts` (document, start) pairs drawn with
    `random.Random(seed).sample` from `window_candidates`, in the order drawn (window i = prompt{i}).
    `documents` are token id lists. No window crosses a document boundary; each has exactly
    `prompt_length` tokens: `documents[d][start:start + prompt_length]`."""
    import random

    candidates = window_candidates(documents, prompt_length)
    if len(candidates) < num_prompts:
        raise ValueError(
            f"the corpus has {len(candidates)} windows of {prompt_length} tokens inside one document, "
            f"fewer than the {num_prompts} asked for"
        )
    return random.Random(seed).sample(candidates, num_prompts)


class CorpusTokenizer:
    """The checkpoint's tokenizer for the corpus: its `tokenizer.json` through the `tokenizers` package (the
    protocol's rule), else transformers' AutoTokenizer (e.g. a checkpoint with a custom tokenizer class and
    `--trust-remote-code`). No special tokens are added."""

    def __init__(self, model_dir, trust_remote_code):
        path = os.path.join(model_dir, "tokenizer.json")
        self.backend = None
        self.hf = None
        if os.path.isfile(path):
            try:
                import tokenizers
            except ImportError:
                tokenizers = None
            if tokenizers is not None:
                self.backend = tokenizers.Tokenizer.from_file(path)
                self.description = f"tokenizer.json through tokenizers {tokenizers.__version__}, no special tokens"
                return
        import transformers

        self.hf = load_tokenizer(transformers, model_dir, trust_remote_code, required=True)
        self.description = f"transformers AutoTokenizer ({type(self.hf).__name__}), add_special_tokens=False"

    def encode(self, texts):
        if self.backend is not None:
            return [list(encoding.ids) for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]
        return [list(self.hf(text, add_special_tokens=False)["input_ids"]) for text in texts]

    def decode(self, ids):
        if self.backend is not None:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.hf.decode(list(ids), skip_special_tokens=False)


def free_running_greedy(torch, model, windows, steps, device, method):
    """Free-running greedy continuations of equal-length windows (one batch): (tokens i64 [B, steps], logits f32
    [B, steps, vocab]) on the CPU, each token the argmax of the float32-cast logits that precede it; it never stops
    at EOS. `cached`: one forward over the windows with the model's cache, then one token per step through it;
    `recompute`: a full forward without cache over the window and the tokens before it at every step."""
    x = torch.tensor(windows, dtype=torch.long, device=device)
    rows = []
    tokens = []
    with torch.no_grad():
        if method == "recompute":
            sequence = x
            for _ in range(steps):
                out = model(input_ids=sequence, attention_mask=torch.ones_like(sequence), use_cache=False, return_dict=True)
                last = out.logits[:, -1].to(torch.float32)
                chosen = torch.argmax(last, dim=-1)
                rows.append(last.cpu())
                tokens.append(chosen.cpu())
                sequence = torch.cat([sequence, chosen[:, None]], dim=1)
        else:
            argument = cache_argument(model)
            mask = torch.ones_like(x)
            out = model(input_ids=x, attention_mask=mask, use_cache=True, return_dict=True)
            for step in range(steps):
                last = out.logits[:, -1].to(torch.float32)
                chosen = torch.argmax(last, dim=-1)
                rows.append(last.cpu())
                tokens.append(chosen.cpu())
                if step + 1 == steps:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(
                    input_ids=chosen[:, None],
                    attention_mask=mask,
                    use_cache=True,
                    return_dict=True,
                    **{argument: returned_cache(out)},
                )
    return torch.stack(tokens, dim=1).to(torch.int64).contiguous(), torch.stack(rows, dim=1).contiguous()


def teacher_forced(torch, model, sequences, device):
    """One forward without cache over equal-length sequences (one batch): logits f32 [B, T, vocab] on the CPU."""
    x = torch.tensor(sequences, dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, return_dict=True)
    return out.logits.to(torch.float32).cpu().contiguous()


def batches(items, size):
    for start in range(0, len(items), size):
        yield start, items[start:start + size]


def corpus_run(torch, model, windows, args, suffix, tensors, teacher_continuations):
    """Writes prompt{i}.greedy_{suffix}, .greedy_{suffix}_logits and .teacher_{suffix}_logits for every window;
    the teacher sequence is the window followed by `teacher_continuations[i]` (the float32 continuation), or by
    this run's own continuation when None (the float32 run). Returns the continuations."""
    continuations = []
    for start, batch in batches(windows, args.batch_size):
        tokens, logits = free_running_greedy(torch, model, batch, args.decode_length, args.device, args.greedy)
        if teacher_continuations is None:
            follow = tokens.tolist()
        else:
            follow = teacher_continuations[start:start + len(batch)]
        teacher = teacher_forced(torch, model, [w + f for w, f in zip(batch, follow)], args.device)
        for offset in range(len(batch)):
            name = f"prompt{start + offset}"
            tensors[f"{name}.greedy_{suffix}"] = tokens[offset].clone()
            tensors[f"{name}.greedy_{suffix}_logits"] = logits[offset].clone()
            tensors[f"{name}.teacher_{suffix}_logits"] = teacher[offset].clone()
            continuations.append(tokens[offset].tolist())
        print(f"reference_dump: {suffix}: windows {start}..{start + len(batch) - 1} done", file=sys.stderr)
    return continuations


def corpus_facts(torch, tensors, num_prompts, prompt_length, decode_length):
    """Checks of the reference on itself, for golden.json: the greedy step logits against the teacher-forced rows
    that predict the same tokens (float32), and how often the bf16 continuation equals the f32 one."""
    deviation = 0.0
    mismatches = 0
    gap = None
    bf16_equal = 0
    for i in range(num_prompts):
        step = tensors[f"prompt{i}.greedy_f32_logits"]
        rows = tensors[f"prompt{i}.teacher_f32_logits"][prompt_length - 1:prompt_length - 1 + decode_length]
        deviation = max(deviation, float((step - rows).abs().max()))
        mismatches += int((rows.argmax(dim=-1) != tensors[f"prompt{i}.greedy_f32"]).sum())
        this_gap = min_top1_top2_gap(torch, step)
        if this_gap is not None:
            gap = this_gap if gap is None else min(gap, this_gap)
        bf16_equal += int(torch.equal(tensors[f"prompt{i}.greedy_bf16"], tensors[f"prompt{i}.greedy_f32"]))
    return {
        "greedy_f32_vs_teacher_f32_max_abs_logit_diff": deviation,
        "greedy_f32_teacher_argmax_mismatches": mismatches,
        "greedy_f32_min_top1_top2_gap": gap,
        "greedy_bf16_equal_to_f32_prompts": bf16_equal,
    }


def corpus_main(args, argv):
    torch, transformers = import_stack()
    if args.modeling:
        register_modeling(transformers, args.modeling)
    from safetensors.torch import save_file

    model_dir = args.model
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        fail(f"{model_dir} has no config.json")
    device = setup_device(torch, args.device)

    texts = read_corpus(args.corpus)
    tokenizer = CorpusTokenizer(model_dir, args.trust_remote_code)
    documents = tokenizer.encode(texts)
    try:
        positions = sample_windows(documents, args.prompt_length, args.num_prompts, args.seed)
    except ValueError as error:
        fail(str(error))
    windows = [documents[d][s:s + args.prompt_length] for d, s in positions]
    available = len(window_candidates(documents, args.prompt_length))
    print(
        f"reference_dump: {len(texts)} documents, {sum(map(len, documents))} tokens, {available} windows of "
        f"{args.prompt_length} tokens; sampled {len(windows)} with seed {args.seed}",
        file=sys.stderr,
    )

    tensors = {}
    for i, window in enumerate(windows):
        tensors[f"prompt{i}.ids"] = torch.tensor(window, dtype=torch.int64)

    print(f"reference_dump: float32 run of {model_dir} on {device} (batch {args.batch_size})", file=sys.stderr)
    model = load_model(torch, transformers, model_dir, torch.float32, device, args)
    embeddings = model.get_input_embeddings().num_embeddings
    largest = max(max(window) for window in windows)
    if largest >= embeddings:
        fail(f"token id {largest} of the corpus is outside the embedding table ({embeddings} rows)")
    f32_continuations = corpus_run(torch, model, windows, args, "f32", tensors, None)
    attn_f32 = implementation(model, "attn")
    experts = implementation(model, "experts")
    class_name = type(model).__name__
    del model
    release(torch, device)

    print("reference_dump: bfloat16 run", file=sys.stderr)
    model = load_model(torch, transformers, model_dir, torch.bfloat16, device, args)
    attn_bf16 = implementation(model, "attn")
    corpus_run(torch, model, windows, args, "bf16", tensors, f32_continuations)
    del model
    release(torch, device)

    os.makedirs(args.out, exist_ok=True)
    corpus_name = os.path.basename(args.corpus)
    corpus_copy = os.path.join(args.out, corpus_name)
    if not (os.path.exists(corpus_copy) and os.path.samefile(corpus_copy, args.corpus)):
        shutil.copyfile(args.corpus, corpus_copy)

    # The vendored trained-tiny-corpus golden.json's keys, in its order, then what this dumper adds.
    golden = {
        "num_prompts": args.num_prompts,
        "prompt_length": args.prompt_length,
        "decode_length": args.decode_length,
        "seed": args.seed,
        "corpus": corpus_name,
        "windows": [tokenizer.decode(window) for window in windows],
        "window_positions": [{"document": d, "start": s} for d, s in positions],
        "reference": {
            "implementation": f"huggingface/transformers {class_name}",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "device": device,
            "device_name": device_description(torch, device),
            "batch_size": args.batch_size,
            "greedy": (
                "cached: one forward over the window with the model's cache, then one token per step through it"
                if args.greedy == "cached"
                else "recompute: a full forward without cache over the window and the tokens before it at every step"
            ) + "; argmax of float32-cast logits; does not stop at EOS",
            "attn_implementation": attn_f32,
            "attn_implementation_bf16": attn_bf16,
            "experts_implementation": experts,
            "bf16_buffers": bf16_buffers(args),
            "modeling": modeling_source(args),
            "tf32": False,
            "trust_remote_code": args.trust_remote_code,
            "checkpoint": os.path.abspath(model_dir),
            "tokenizer": tokenizer.description,
            "corpus_documents": len(texts),
            "corpus_windows_available": available,
            "command": ["tools/reference_dump.py"] + list(argv),
        },
    }
    golden["reference"].update(
        corpus_facts(torch, tensors, args.num_prompts, args.prompt_length, args.decode_length)
    )
    metadata = {
        "num_prompts": str(args.num_prompts),
        "prompt_length": str(args.prompt_length),
        "seed": str(args.seed),
        "decode_length": str(args.decode_length),
    }
    save_file(tensors, os.path.join(args.out, "golden.safetensors"), metadata=metadata)
    with open(os.path.join(args.out, "golden.json"), "w", encoding="utf-8") as handle:
        json.dump(golden, handle, indent=1, ensure_ascii=False)
    print(
        f"reference_dump: wrote {os.path.join(args.out, 'golden.safetensors')} ({args.num_prompts} windows of "
        f"{args.prompt_length} tokens, {args.decode_length} greedy tokens each) and golden.json"
    )
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.corpus:
        return corpus_main(args, argv)
    torch, transformers = import_stack()
    if args.modeling:
        register_modeling(transformers, args.modeling)
    from safetensors.torch import save_file

    model_dir = args.model
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        fail(f"{model_dir} has no config.json")
    config = read_json(config_path)

    device = setup_device(torch, args.device)

    tokenizer = load_tokenizer(transformers, model_dir, args.trust_remote_code, required=not args.ids)
    sequences = build_sequences(args, tokenizer)
    if not 0 <= args.gen_prompt < len(sequences):
        fail(f"--gen-prompt {args.gen_prompt}: there are {len(sequences)} sequences")

    tensors = {}
    entries = []
    print(f"reference_dump: float32 run of {model_dir} on {device}", file=sys.stderr)
    model = load_model(torch, transformers, model_dir, torch.float32, device, args)
    embeddings = model.get_input_embeddings().num_embeddings
    for index, (ids, _) in enumerate(sequences):
        if max(ids) >= embeddings:
            fail(f"seq{index}: token id {max(ids)} is outside the embedding table ({embeddings} rows)")
    vocab = None
    f32_logits = []
    for index, (ids, facts) in enumerate(sequences):
        logits, hidden = forward(torch, model, ids, device, hidden_states=args.hidden_states)
        vocab = logits.shape[-1]
        name = f"seq{index}"
        tensors[f"{name}.input_ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"{name}.logits_f32"] = logits
        if hidden is not None:
            tensors[f"{name}.hidden_states_f32"] = hidden
        f32_logits.append(logits)
        entry = {"index": index, "len": len(ids)}
        entry.update(facts)
        entry["logits_abs_max_f32"] = float(logits.abs().max())
        entry["min_top1_top2_gap_f32"] = min_top1_top2_gap(torch, logits)
        entry["reference_incremental_max_abs_dev"] = incremental_deviation(torch, model, ids, logits, device)
        if facts["input"] == "chat" and not args.no_completions:
            entry["greedy_completion_text"] = greedy_completion(torch, model, tokenizer, ids, args.gen_tokens, device)
        entries.append(entry)
        print(f"reference_dump: seq{index}: {len(ids)} tokens", file=sys.stderr)

    prompt = sequences[args.gen_prompt][0]
    output_ids, step_logits = greedy_no_cache(torch, model, prompt, args.gen_tokens, device)
    tensors["gen.prompt_ids"] = torch.tensor(prompt, dtype=torch.int64)
    tensors["gen.output_ids"] = torch.tensor(output_ids, dtype=torch.int64)
    tensors["gen.step_logits_f32"] = step_logits
    generation = {
        "prompt": f"seq{args.gen_prompt}",
        "prompt_len": len(prompt),
        "new_tokens": len(output_ids),
        "decoding": "greedy, argmax of f32 logits recomputed from scratch at every step (no cache), "
        "does not stop at EOS",
        "min_top1_top2_gap": min_top1_top2_gap(torch, step_logits),
    }
    if tokenizer is not None:
        generation["text"] = tokenizer.decode(output_ids, skip_special_tokens=False)
    attn_f32 = implementation(model, "attn")
    experts = implementation(model, "experts")
    class_name = type(model).__name__
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    attn_bf16 = None
    if not args.no_bf16:
        print("reference_dump: bfloat16 run", file=sys.stderr)
        model = load_model(torch, transformers, model_dir, torch.bfloat16, device, args)
        attn_bf16 = implementation(model, "attn")
        for index, (ids, _) in enumerate(sequences):
            logits, _ = forward(torch, model, ids, device)
            tensors[f"seq{index}.logits_bf16"] = logits
            reference = f32_logits[index]
            agree = (logits.argmax(dim=-1) == reference.argmax(dim=-1)).to(torch.float32).mean()
            entries[index]["bf16_vs_f32_argmax_match"] = float(agree)
            entries[index]["bf16_vs_f32_max_abs_logit_diff"] = float((logits - reference).abs().max())
        del model
        gc.collect()

    reference = {
        "implementation": f"huggingface/transformers {class_name}",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": device,
        "device_name": device_description(torch, device),
        "dtype": "float32 (logits_f32, hidden_states_f32, gen.*)",
        "bf16_dtype": None if args.no_bf16 else "bfloat16 (logits_bf16: model loaded in bfloat16, logits cast to float32)",
        "attn_implementation": attn_f32,
        "attn_implementation_bf16": attn_bf16,
        "experts_implementation": experts,
        "bf16_buffers": None if args.no_bf16 else bf16_buffers(args),
        "modeling": modeling_source(args),
        "tf32": False,
        "trust_remote_code": args.trust_remote_code,
        "checkpoint": os.path.abspath(model_dir),
        "checkpoint_dtype": config.get("dtype", config.get("torch_dtype")),
        "bos_policy": args.bos if args.prompt else None,
        "command": ["tools/reference_dump.py"] + argv,
    }
    golden = {
        "fixture": args.name or fixture_name(model_dir),
        "reference": reference,
        "sequences": entries,
        "generation": generation,
    }
    if args.hidden_states:
        golden["hidden_states_layout"] = (
            "[num_hidden_layers+1, T, hidden]: transformers' output_hidden_states (index 0 = embeddings, "
            "last entry = after the final norm)"
        )
    golden["config"] = config

    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "golden.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "golden.json"), "w", encoding="utf-8") as handle:
        json.dump(golden, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
    print(
        f"reference_dump: wrote {os.path.join(args.out, 'golden.safetensors')} "
        f"({len(sequences)} sequences, vocab {vocab}, {len(output_ids)} greedy tokens) and golden.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
