"""The chat template `vllm serve` gets: the checkpoint's, each video as `<|video_pad|>` alone, content-addressed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from inference.vllm_server import serving_chat_template
from model_io.vllm_support import VLLMServeError


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n<|vision_start|><|video_pad|><|vision_end|>{% endfor %}"
SERVED = "{% for m in messages %}<|im_start|>{{ m.role }}\n<|video_pad|>{% endfor %}"


def test_the_served_template_unwraps_the_video_and_is_written_once(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    out_dir = tmp_path / "templates"
    path = serving_chat_template(ckpt, out_dir)
    assert path == out_dir / f"chat_template-{hashlib.sha256(SERVED.encode()).hexdigest()[:16]}.jinja"
    assert path.read_text() == SERVED
    assert sorted(p.name for p in out_dir.iterdir()) == [path.name]  # no temporary file left
    inode = path.stat().st_ino
    assert serving_chat_template(ckpt, out_dir) == path
    assert path.stat().st_ino == inode  # found, not written again (a rewrite renames a new file into place)


def test_a_template_without_the_video_triple_is_refused(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(VLLMServeError, match="no chat template rendering a video as"):
        serving_chat_template(tmp_path, tmp_path / "templates")
    assert not (tmp_path / "templates").exists()
