"""Masks and boundaries: from lengths only, under both paddings, pad == eos, pad inside responses."""

import pytest
import torch

from redteam_grpo.core.tokens.masks import (
    gather_completion_logits,
    logits_window,
    pack_sequences,
    pack_spans,
    split_generated,
)

PAD = 0
EOS = 9


@pytest.mark.parametrize("padding", ["left", "right"])
def test_completion_positions_point_at_the_logits_that_predict_each_completion_token(padding):
    # Prompts of very different lengths; the completion of row 1 contains the pad id and ends with eos == pad.
    prompts = [[5, 6], [7, 7, 7, 7, 7, 7, 7]]
    completions = [[11, 12, EOS], [PAD, 13, PAD]]
    packed = pack_sequences(prompts, completions, pad_id=PAD, padding=padding)
    # A "model" whose logits at t are one-hot of the token at t + 1: gathering must give back the completion.
    ids = packed.input_ids_B_T
    next_ids = torch.roll(ids, -1, dims=1)
    logits = torch.nn.functional.one_hot(next_ids, 16).float()
    predicted = gather_completion_logits(logits, packed).argmax(-1)
    mask = packed.completion_mask_B_C
    assert mask.tolist() == [[True, True, True], [True, True, True]]
    assert predicted[mask].tolist() == [11, 12, EOS, PAD, 13, PAD]


@pytest.mark.parametrize("padding", ["left", "right"])
def test_mask_covers_exactly_the_completion_tokens_of_each_row(padding):
    prompts = [[1, 2, 3, 4, 5], [1]]
    completions = [[6], [7, 8, 9, 10]]
    packed = pack_sequences(prompts, completions, pad_id=PAD, padding=padding)
    assert packed.completion_mask_B_C.sum(-1).tolist() == [1, 4]
    # every real token is attended, no pad is
    assert packed.attention_mask_B_T.sum(-1).tolist() == [6, 5]
    # the tokens the mask selects, read from the packed ids at position + 1, are the completion
    for b in range(2):
        positions = packed.logit_positions_B_C[b][packed.completion_mask_B_C[b]] + 1
        assert packed.input_ids_B_T[b, positions].tolist() == completions[b]


def test_position_ids_start_at_zero_on_the_first_real_token_under_left_padding():
    packed = pack_sequences([[3, 3], [4, 4, 4, 4]], [[5], [5]], pad_id=PAD, padding="left")
    assert packed.position_ids_B_T[0].tolist() == [0, 0, 0, 1, 2]
    assert packed.position_ids_B_T[1].tolist() == [0, 1, 2, 3, 4]


def test_split_generated_cuts_at_the_absolute_input_width_not_at_the_count_of_non_pad_tokens():
    # pad == eos == 9 (Llama-3 style). Row 0 is a short prompt, left padded with 9s.
    input_width = 5
    sequences = torch.tensor(
        [
            [9, 9, 9, 1, 2, 30, 31, 9, 9],  # completion [30, 31, 9]; the trailing 9 is generate's padding
            [1, 2, 3, 4, 5, 9, 9, 9, 9],  # ends at once: completion is [9] (one EOS, length 1)
            [1, 2, 3, 4, 5, 40, 41, 42, 43],  # no end-of-turn: truncated
        ]
    )
    completions, reasons = split_generated(sequences, input_width, end_of_turn_ids=[9])
    assert completions == [[30, 31, 9], [9], [40, 41, 42, 43]]
    assert reasons == ["stop", "stop", "length"]


def test_split_generated_keeps_pad_ids_that_were_sampled_inside_a_response():
    # pad = 0 differs from the end-of-turn 9; a sampled 0 mid-response is part of the response
    sequences = torch.tensor([[0, 1, 2, 0, 5, 9, 0]])
    completions, _ = split_generated(sequences, 3, end_of_turn_ids=[9, 8])
    assert completions == [[0, 5, 9]]


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        pack_sequences([[]], [[1]], pad_id=PAD)


def test_end_of_turn_ids_include_the_chat_end_token_when_eos_is_another():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from redteam_grpo.core.models.chat import end_of_turn_ids

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    # Qwen3 base-style: eos is <|endoftext|> but a chat turn ends with <|im_end|>
    assert end_of_turn_ids(tok) == [0, 2]
    assert end_of_turn_ids(tok, generation_eos=[2, 0]) == [0, 2]


@pytest.mark.parametrize("padding", ["left", "right"])
def test_logits_of_the_window_alone_gather_what_the_logits_of_every_position_gather(padding):
    # Single-turn rows of different prompt lengths, and dialogue rows whose trained spans start at different places.
    for packed in (
        pack_sequences([[5, 6, 7, 8, 9], [7, 7], [1, 2, 3]], [[11, 12], [13, 14, 15, EOS], []], PAD, padding),
        pack_spans([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4]], [[(3, 4), (6, 8)], [(2, 4)]], PAD, padding),
    ):
        width = packed.input_ids_B_T.shape[1]
        logits = torch.randn(packed.input_ids_B_T.shape[0], width, 16)
        keep = logits_window(packed)
        mask = packed.completion_mask_B_C
        expected = gather_completion_logits(logits, packed)[mask]
        assert torch.equal(gather_completion_logits(logits[:, width - keep :], packed)[mask], expected)
        # the window is the smallest that holds them: one position fewer drops a trained token's logits
        with pytest.raises(ValueError, match="before the last"):
            gather_completion_logits(logits[:, width - keep + 1 :], packed)


def test_the_window_starts_at_the_earliest_trained_token_of_the_batch():
    # right padding: row 0's completion starts after 4 prompt tokens, row 1's after 2; the packed rows are 6 wide
    packed = pack_sequences([[1, 2, 3, 4], [1, 2]], [[5, 6], [3]], PAD, "right")
    assert logits_window(packed) == 6 - 1  # the logits at index 1 predict row 1's first completion token
    assert logits_window(pack_sequences([[1, 2]], [[]], PAD, "right")) == 1  # nothing trained: 0 would mean all
