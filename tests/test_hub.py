"""Resolving a hub model's commit."""

from __future__ import annotations

import pytest

from isotui.errors import IsotuiError


def test_a_hub_answer_without_a_commit_is_one_sentence(monkeypatch):
    """The hub's model info may leave out the commit (``sha`` None): a sentence, never None."""
    import huggingface_hub

    from isotui.models.hub import resolve_commit

    class Info:
        sha = None

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, revision=None: Info())
    with pytest.raises(IsotuiError, match="gave no commit for model 'someorg/some-model'"):
        resolve_commit("someorg/some-model", None)
