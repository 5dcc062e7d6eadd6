"""The runner's prompt order: epochs, shuffling from the seed, prompts handed back, checkpointed position."""

from __future__ import annotations

import pytest

from asyncrl_core.runner.dataloader import PromptLoader


def _issue(loader: PromptLoader, count: int) -> list[int]:
    return [loader.advance() for _ in range(count)]


def test_each_epoch_is_a_permutation_shuffled_from_the_seed() -> None:
    loader = PromptLoader(10, shuffle=True, seed=7)
    first, second = _issue(loader, 10), _issue(loader, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert loader.epoch == 1
    again = PromptLoader(10, shuffle=True, seed=7)
    assert _issue(again, 20) == first + second
    assert _issue(PromptLoader(10, shuffle=True, seed=8), 10) != first


def test_without_shuffle_prompts_come_in_dataset_order() -> None:
    loader = PromptLoader(3, shuffle=False, seed=0)
    assert _issue(loader, 7) == [0, 1, 2, 0, 1, 2, 0]


def test_a_prompt_handed_back_comes_again_after_the_next_epoch() -> None:
    loader = PromptLoader(3, shuffle=False, seed=0)
    assert _issue(loader, 2) == [0, 1]
    loader.give_back(1)
    # The rest of epoch 0, all of epoch 1, then the returned prompt, then epoch 2.
    assert _issue(loader, 1 + 3 + 1 + 3) == [2, 0, 1, 2, 1, 0, 1, 2]


def test_peek_does_not_issue() -> None:
    loader = PromptLoader(2, shuffle=False, seed=0)
    assert loader.peek() == loader.peek() == 0
    assert loader.advance() == 0
    assert loader.peek() == 1


def test_state_restores_the_same_order() -> None:
    loader = PromptLoader(5, shuffle=True, seed=1)
    _issue(loader, 7)
    loader.give_back(3)
    state = loader.state()
    expected = _issue(loader, 12)
    restored = PromptLoader(5, shuffle=True, seed=1)
    restored.restore(state)
    assert _issue(restored, 12) == expected


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no prompts"):
        PromptLoader(0, shuffle=True, seed=0)
    loader = PromptLoader(2, shuffle=False, seed=0)
    with pytest.raises(ValueError, match="outside the dataset"):
        loader.give_back(2)
    assert _issue(loader, 2) == [0, 1]
