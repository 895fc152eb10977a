"""Writes tests/data/smollm2_reference.json: llama.cpp's own answers on the default model's GGUF, for test_gguf_parity.

Tokenizer: llama.cpp's token ids and detokenized text for a varied text set, and llama-cpp-python's rendering of the
chat template. Logits: llama.cpp's teacher-forced log-probabilities (float32 KV cache) and its greedy continuations
with each step's top-2 margin, so the test knows where a near-tie lets two correct implementations part; twice:
on the Q4_1 file itself ("logits": llama.cpp quantizes activations to 8 bits for its Q4_1/Q8_0 dot products) and
on a copy with every tensor dequantized to F32 ("logits_f32": the same float32 weights Capstan serves, so only
float rounding separates the two implementations).

Needs llama-cpp-python (built from source here; not a test dependency):
    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python && python tests/data/make_gguf_reference.py"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. I'm sure we'll see they've DON'T can't.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # recursion\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Numbers: 1234567890, 3.14159, -42, 1e-10, 2024-11-23",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️",
    "中文分词测试：今天天气很好。日本語のテキスト。한국어 문장입니다.",
    "Ünïcödé àccents — “quotes” ‘single’ … naïve café résumé",
    "Arabic: مرحبا بالعالم, Hindi: नमस्ते दुनिया, Russian: Привет, мир",
    "   leading spaces\n\n\n\ttabs\t\tand    runs      of   spaces   \n \n",
    "trailing whitespace   ",
    "\n",
    " ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <file_sep> and <jupyter_code>",
    "https://example.com/path?query=1&b=2#frag user@example.com",
    "ALL CAPS AND lowercase AND MiXeD CaSe",
]
CHATS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little",
    "1, 2, 3, 4, 5,",
]
TOP = 10  # alternatives kept per position
GREEDY_TOKENS = 24


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# tokenizer kinds the default model does not use, in GGUF files tests/gguf_files.py writes the same way again
OTHER_TOKENIZERS = ["llama-bpe", "qwen2", "gpt-2", "spm", "spm-no-prefix"]


def other_tokenizers() -> dict[str, list[list[int]]]:
    import tempfile

    from llama_cpp import Llama

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from gguf_files import GOLDEN_TOKENIZER_CASE, write_gguf, write_toy_spm_gguf
    from golden import GOLDEN

    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in OTHER_TOKENIZERS:
            file = Path(tmp) / f"{kind}.gguf"
            if kind.startswith("spm"):
                write_toy_spm_gguf(file, add_space_prefix=kind == "spm")
            else:
                write_gguf(GOLDEN / GOLDEN_TOKENIZER_CASE, file, pre=kind)
            vocab = Llama(str(file), vocab_only=True, verbose=False)
            found[kind] = [vocab.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS]
    return found


def tokenizer_and_logits(gguf_path: str):
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = Llama(gguf_path, vocab_only=True, verbose=False)
    tokenizer = []
    for text in TEXTS:
        ids = vocab.tokenize(text.encode(), add_bos=True, special=True)
        tokenizer.append(
            {
                "text": text,
                "ids": ids,
                "decoded": vocab.detokenize(ids, special=True).decode("utf-8", "replace"),
                "decoded_skip_special": vocab.detokenize(ids, special=False).decode("utf-8", "replace"),
            }
        )
    meta = vocab.metadata
    tokens = [vocab._model.token_get_text(i) for i in range(vocab.n_vocab())]
    formatter = Jinja2ChatFormatter(
        meta["tokenizer.chat_template"],
        eos_token=tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        bos_token=tokens[int(meta["tokenizer.ggml.bos_token_id"])],
    )
    chats = [{"messages": m, "rendered": formatter(messages=m).prompt} for m in CHATS]
    for chat in chats:
        chat["ids"] = vocab.tokenize(chat["rendered"].encode(), add_bos=False, special=True)

    prompts = [vocab.tokenize(p.encode(), add_bos=True, special=True) for p in PROMPTS] + [c["ids"] for c in chats]
    logits = run_logits(gguf_path, prompts)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        logits_f32 = run_logits(dequantized_copy(gguf_path, Path(tmp) / "f32.gguf"), prompts)
    return tokenizer, chats, logits, logits_f32


def run_logits(gguf_path: str | Path, prompts: list[list[int]]) -> list[dict]:
    from llama_cpp import Llama, llama_cpp

    # float32 K/V so that llama.cpp's f16 cache adds no difference of its own
    llm = Llama(
        str(gguf_path),
        n_ctx=512,
        n_batch=512,
        logits_all=True,
        n_threads=2,
        seed=0,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    logits = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        lp = log_softmax(np.asarray(llm.scores[: len(ids)]))
        positions = []
        for i in range(len(ids)):
            top = np.argsort(-lp[i])[:TOP]
            positions.append(
                {
                    "next": ids[i + 1] if i + 1 < len(ids) else None,
                    "next_logprob": float(lp[i, ids[i + 1]]) if i + 1 < len(ids) else None,
                    "top_ids": top.tolist(),
                    "top_logprobs": [round(float(v), 5) for v in lp[i, top]],
                }
            )
        greedy, margins = [], []
        last = lp[-1]
        for _ in range(GREEDY_TOKENS):
            a, b = np.sort(last)[-2:][::-1]
            token = int(np.argmax(last))
            greedy.append(token)
            margins.append(round(float(a - b), 5))
            llm.eval([token])
            last = log_softmax(np.asarray(llm.scores[llm.n_tokens - 1]))
        logits.append({"prompt_ids": ids, "positions": positions, "greedy": greedy, "greedy_top2_margins": margins})
    return logits


def dequantized_copy(gguf_path: str, out: Path) -> Path:
    """The same file with every tensor dequantized to F32: metadata copied field by field."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    architecture = reader.get_field("general.architecture")
    assert architecture is not None, f"{gguf_path}: no general.architecture"
    writer = gguf.GGUFWriter(str(out), architecture.contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(
            t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write(gguf_path: str, out: Path) -> None:
    import llama_cpp as lc

    tokenizer, chats, logits, logits_f32 = tokenizer_and_logits(gguf_path)
    out.write_text(
        json.dumps(
            {
                "gguf": Path(gguf_path).name,
                "llama_cpp_python": lc.__version__,
                "kv_cache": "f32",
                "tokenizer": tokenizer,
                "chats": chats,
                "logits": logits,
                "logits_f32": logits_f32,
                "other_tokenizers": other_tokenizers(),
            },
            ensure_ascii=False,
            indent=0,
        )
    )
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    from capstan.runtime.config import installed_smollm2

    write(
        sys.argv[1] if len(sys.argv) > 1 else str(installed_smollm2()), Path(__file__).parent / "smollm2_reference.json"
    )
