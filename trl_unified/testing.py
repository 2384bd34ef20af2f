"""Tiny models (from configs, random weights) and tokenizers (trained with `tokenizers`) built locally, no Hub, for
tests, examples and benchmarks; `save_tiny_model` writes a directory that loads back with `from_pretrained(path)`;
`peak_rss_kib` is the process's peak resident memory as benchmarks and memory tests read it."""

import os
import resource
from unittest import mock

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + ' <|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + ' <|im_end|>' }}{% endif %}"
    "{{ ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def peak_rss_kib() -> int:
    """This process's peak resident set size in KiB, from `VmHWM` in `/proc/self/status`.

    Not `getrusage(RUSAGE_SELF).ru_maxrss`: Linux keeps that high-water mark across `execve`, and a child started by
    `subprocess` (vfork + exec) inherits the parent's mark, so a 12 GB pytest worker's children all report 12 GB.
    `VmHWM` belongs to the address space, which `execve` replaces. Falls back to `ru_maxrss` where /proc is absent."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
DEFAULT_WORDS = (
    "a b c d e f g h i j k l m n o p q r s t u v w x y z "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 "
    "user assistant system the is which larger smaller number response better answer <answer> </answer> or and "
    "A B yes no count write say hello world question : ? . , + = >"
).split()


def build_tokenizer(words: list[str] | None = None, pad_token: str | None = "<pad>") -> PreTrainedTokenizerFast:
    """A word-level tokenizer (whitespace split) trained with `tokenizers`, with a ChatML-like chat template.

    `pad_token=None` leaves the pad token unset (the trainers then fall back to EOS).
    """
    words = words or DEFAULT_WORDS
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    core.train_from_iterator(
        [" ".join(words)] * 2,
        trainers.WordLevelTrainer(  # every word kept (the trainer's default cap is 30,000)
            vocab_size=len(set(words)) + len(SPECIAL_TOKENS), special_tokens=SPECIAL_TOKENS, min_frequency=1
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token=pad_token,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _common(tokenizer, hidden_size, num_layers):
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def build_causal_lm(tokenizer, arch: str = "qwen2", hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """A randomly initialised causal LM of `arch` ("qwen2", "llama" or "qwen3")."""
    import transformers

    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[arch]
    config_cls, model_cls = (getattr(transformers, prefix + suffix) for suffix in ("Config", "ForCausalLM"))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**_common(tokenizer, hidden_size, num_layers)))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def build_sequence_classifier(tokenizer, hidden_size: int = 32, seed: int = 0):
    """A randomly initialised Llama sequence classifier with one label (a reward model)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    return LlamaForSequenceClassification(LlamaConfig(**_common(tokenizer, hidden_size, 2), num_labels=1))


def build_encoder_decoder(tokenizer, d_model: int = 32, seed: int = 0):
    """A randomly initialised T5-style encoder-decoder."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=d_model * 2,
        num_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        dropout_rate=0.0,
    )
    model = T5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.decoder_start_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(model, tokenizer, path: str) -> str:
    """Save model + tokenizer to `path` (loadable by path, like a Hub id) and return `path`."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|> ' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|> ' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ ' <|im_end|> ' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def build_vision_language_model(words: list[str] | None = None, seed: int = 0, video: bool = False):
    """A tiny Qwen2-VL model (1 vision block, 2 text layers) and its processor (PIL image processor, no torchvision).

    Returns `(model, processor)`. transformers 5.x checks a processor's parts against the torchvision-backed base
    classes when torchvision is absent and fails; the check is skipped while the processor is built (the PIL image
    processor itself needs no torchvision). `video=True` adds Qwen2-VL's video processor (frames of at most 56x56,
    2 frames per temporal patch), which needs torchvision (`pip install trl_unified[vision]`).
    """
    from transformers import ProcessorMixin, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tokenizer(words)
    special = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    video_processor = None
    if video:
        from transformers import Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor(
            size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56},
            patch_size=14,
            merge_size=2,
            temporal_patch_size=2,
            cap_pixels_per_frame=False,
        )
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)):
        processor = Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=VL_CHAT_TEMPLATE,
        )
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(_common(tokenizer, 32, 2), rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        # Qwen2-VL's default patch_size=14, spatial_merge_size=2 and temporal_patch_size=2, as the image processor's
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, in_chans=3),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processor


def build_image(seed: int = 0, size: int = 56):
    """A random RGB PIL image."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype("uint8"))


def build_video(trend: str, seed: int = 0, frames: int = 4, size: int = 56):
    """`(frames, size, size, 3)` uint8 frames of a random texture that gets `"brighter"` or `"darker"` from frame to
    frame (the toy task of the video judge tests: only the order of the frames tells the answer)."""
    rng = np.random.default_rng(seed)
    texture = rng.random((size, size, 3)) * 60
    levels = rng.uniform(20, 80) + 30 * np.arange(frames)  # the same levels either way, in opposite orders
    levels = levels if trend == "brighter" else levels[::-1]
    video = [texture + level + rng.normal(0, 5, (size, size, 3)) for level in levels]
    return np.clip(np.stack(video), 0, 255).astype("uint8")


def trl_chat_template(name: str) -> str:
    """A chat template shipped with trl (`trl/chat_templates/<name>.jinja`, e.g. "qwen2_5", TRL's tool-calling
    ChatML template). TRL recognises its own templates (response parsers, training variants) by their exact text."""
    from importlib.resources import files

    return files("trl").joinpath("chat_templates", f"{name}.jinja").read_text()


TOOL_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tool_tokenizer(corpus: list[str] | None = None, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text round-trips, JSON tool calls included) with Qwen2.5's chat tokens and TRL's
    `qwen2_5` chat template, which renders tools and tool calls: a tiny stand-in for a tool-calling instruct model.

    EOS is `<|im_end|>` (the end of an assistant turn) and the pad token `<|endoftext|>`, as in Qwen2.5.
    """
    template = trl_chat_template("qwen2_5")
    texts = [
        *(corpus or []),
        *template.splitlines(),
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
        "What is 3 times 4? The answer is 12. Done!",
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 {}[]():,.!?\"'-_+=*/<>\n",
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        texts * 2,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=TOOL_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TEXT_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = template
    return tokenizer
