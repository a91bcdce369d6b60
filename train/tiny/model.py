"""Build Qwen3-VL models, tokenizers and processors locally from a config: nothing is downloaded.

Used by the tests (a ~0.3 M parameter model), by the demo (`make train-smoke`, `make demo`) and by the device check
(an 8B-shaped model with random weights). The tokenizer is a small byte-level BPE trained here on report-like text
plus Qwen's 14 special tokens, so token ids of the vision placeholders are the tokenizer's, and the model config is
built to agree with them (docs/training.md#qwen3-vl-facts-the-code-relies-on).

    python -m train.tiny.model --output_dir runs/tiny-base       # writes model + processor, loadable by from_pretrained
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from emrl_data.text.report import (
    NEGATIVE_FINDINGS,
    NEGATIVE_IMPRESSION,
    VERIFIER_PROMPT,
    render_evidence,
    render_findings,
    render_impression,
    render_prompt,
    render_report,
)
from emrl_data.types import Organ
from model_io.checkpoint import qwen3_vl_chat_template
from model_io.processor import CTQwen3VLProcessor, make_image_processor


logger = logging.getLogger(__name__)

# Qwen2/3 special tokens in their released order (ids 151643.. in the real vocabulary).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Text shapes: "tiny" for tests and the CPU demo, "8b" = Qwen3-VL-8B-Instruct (docs/training.md#qwen3-vl-facts-the-code-relies-on; vocab 151936).
MODEL_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [8, 4, 4],  # sums to head_dim / 2
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
    },
    "8b": {
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        "vision": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
}


def _corpus() -> list[str]:
    """Return report-like training text for the tiny BPE (every template, prompt and number format we emit)."""
    lines = [VERIFIER_PROMPT, *NEGATIVE_FINDINGS.values(), *NEGATIVE_IMPRESSION.values()]
    locations = {Organ.LIVER: [["1"], ["5", "8"], ["2", "3", "4"]], Organ.PANCREAS: [["head"], ["body", "tail"]]}
    locations[Organ.KIDNEY] = [["left"], ["right"]]
    for organ, locs in locations.items():
        lines.append(render_prompt(organ, 32))
        for i, loc in enumerate(locs):
            for att in ("hypo", "iso", "hyper"):
                kw: dict[str, Any] = {"long_axis_mm": 31.0 + 7 * i, "location": loc, "attenuation": att}
                for count in (1, 3):
                    f = render_findings(
                        organ, has_lesion=True, lesion_count=count, short_axis_mm=22.0, volume_mm3=5400.0, **kw
                    )
                    imp = render_impression(organ, has_lesion=True, lesion_count=count, **kw)
                    lines.append(render_report(f, imp, render_evidence(12 + i, [120, 345, 567, 890])))
    lines.append(" ".join(str(n) for n in range(0, 1001)))
    lines.append("tumor lesion mass cyst abnormality image slice seconds cm mm enhancement size location")
    return lines


def build_tokenizer(vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on report-like text and wrap it with Qwen's special tokens and chat template.

    Deterministic: the same corpus and settings give the same ids on every machine.

    Args:
        vocab_size: target vocabulary size including the 256 byte tokens and the 14 special tokens.

    Returns:
        A fast tokenizer with `eos_token="<|im_end|>"`, `pad_token="<|endoftext|>"` and the Qwen3-VL chat template.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=262144,
        padding_side="left",
        extra_special_tokens={},
    )
    fast.chat_template = qwen3_vl_chat_template()
    return fast


def build_processor(
    tokenizer: PreTrainedTokenizerFast | None = None, *, min_image_pixels: int = 32 * 32
) -> CTQwen3VLProcessor:
    """Return the CT processor around a local tokenizer and the PIL image processor (patch 16, mean/std 0.5).

    Args:
        tokenizer: a tokenizer with Qwen's special tokens; `build_tokenizer()` when None.
        min_image_pixels: the image processor's `shortest_edge` pixel budget. Real Qwen3-VL uses 65536 (256²); tests
            use 32² so a 64² frame stays 64² (a verifier image then costs 4 tokens, not 64).
    """
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    return CTQwen3VLProcessor(
        image_processor=make_image_processor(min_pixels=min_image_pixels),
        tokenizer=tokenizer,
        chat_template=qwen3_vl_chat_template(),
    )


def build_config(tokenizer: PreTrainedTokenizerFast, shape: str = "tiny") -> Qwen3VLConfig:
    """Return a Qwen3-VL config of the given shape whose vision token ids are the tokenizer's.

    Args:
        tokenizer: supplies the ids of `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`.
        shape: a key of `MODEL_SHAPES` ("tiny" or "8b").

    Raises:
        ValueError: on an unknown shape.
    """
    if shape not in MODEL_SHAPES:
        raise ValueError(f"Unknown model shape {shape=}; valid shapes are {sorted(MODEL_SHAPES)}.")
    spec = MODEL_SHAPES[shape]
    vocab = 151936 if shape == "8b" else len(tokenizer)
    ids = {t: cast(int, tokenizer.convert_tokens_to_ids(t)) for t in QWEN_SPECIAL_TOKENS}  # one token: one id
    text = {**spec["text"], "vocab_size": vocab, "pad_token_id": ids["<|endoftext|>"]}
    config = Qwen3VLConfig(
        text_config=text,
        vision_config={**spec["vision"], "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


def build_model(
    tokenizer: PreTrainedTokenizerFast, shape: str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Qwen3VLForConditionalGeneration:
    """Return a randomly initialised Qwen3-VL of the given shape (seeded), with generation ids set.

    Args:
        tokenizer: the tokenizer the model will be used with (see `build_config`).
        shape: "tiny" (~0.3 M parameters) or "8b" (Qwen3-VL-8B-shaped, ~8.8 B parameters: build it on a GPU).
        seed: torch seed for the random weights.
        dtype: parameter dtype.
    """
    torch.manual_seed(seed)
    config = build_config(tokenizer, shape)
    model = Qwen3VLForConditionalGeneration(config).to(dtype)  # type: ignore[arg-type]  # transformers' decorated `to`
    gen = model.generation_config
    gen.eos_token_id = config.eos_token_id
    gen.pad_token_id = config.pad_token_id
    gen.bos_token_id = None
    return model


def save_tiny(output_dir: str | Path, *, seed: int = 0) -> Path:
    """Build a tiny model + processor and save both to `output_dir` (reload with `model_io.processor.load_model_and_processor`)."""
    out = Path(output_dir)
    processor = build_processor()
    model = build_model(processor.tokenizer, seed=seed)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    logger.info("Saved a tiny Qwen3-VL (%d parameters) to %s", model.num_parameters(), out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m train.tiny.model --output_dir DIR [--seed N]`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    save_tiny(args.output_dir, seed=args.seed)


if __name__ == "__main__":
    main()
