import torch

from xlserve.server.engine.sampling import Sampler, StopChecker
from xlserve.server.engine.types import SamplingParams


def log_probs(values):
    return torch.log_softmax(torch.tensor(values, dtype=torch.float32), dim=-1)


def test_greedy_picks_the_argmax():
    assert Sampler(SamplingParams(temperature=0)).choose(log_probs([0.1, 3.0, 0.2])) == 1


def test_top_k_one_is_greedy_whatever_the_temperature():
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=0))
    assert {sampler.choose(log_probs([0.0, 1.0, 0.5])) for _ in range(50)} == {1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert {sampler.choose(row) for _ in range(300)} == {0, 1}


def test_same_seed_same_draws():
    row = log_probs([0.0] * 50)
    a = Sampler(SamplingParams(seed=3))
    b = Sampler(SamplingParams(seed=3))
    assert [a.choose(row) for _ in range(20)] == [b.choose(row) for _ in range(20)]


def test_stop_string_spanning_tokens_is_found_and_held_back():
    checker = StopChecker(["\n\nclass"])
    released = []
    for piece in ["x = 1", "\n", "\n", "cl", "ass Foo"]:
        text, stopped = checker.push(piece)
        released.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(released) == "x = 1"
    assert released[1:4] == ["", "", ""]  # a possible start of the stop string is not released early


def test_false_start_of_a_stop_string_is_released():
    checker = StopChecker(["END"])
    assert checker.push("ab E") == ("ab ", False)
    assert checker.push("x") == ("Ex", False)
    assert checker.flush() == ""


def test_min_p_drops_tokens_far_below_the_most_likely():
    row = torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04]))
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=2))
    assert {sampler.choose(row) for _ in range(300)} == {0, 1}


def test_repetition_penalty_discourages_prompt_and_generated_tokens():
    row = log_probs([2.0, 1.9, 0.0])
    assert Sampler(SamplingParams(temperature=0), prompt=[0]).choose(row) == 0
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0]).choose(row) == 1


def test_presence_and_frequency_penalties_count_generated_tokens():
    row = log_probs([1.0, 0.9, 0.0])
    greedy = Sampler(SamplingParams(temperature=0))
    assert [greedy.choose(row) for _ in range(4)] == [0, 0, 0, 0]
    presence = Sampler(SamplingParams(temperature=0, presence_penalty=0.5))
    assert [presence.choose(row) for _ in range(4)] == [0, 1, 0, 0]  # once each: back to the raw order
    frequency = Sampler(SamplingParams(temperature=0, frequency_penalty=0.3))
    assert [frequency.choose(row) for _ in range(3)] == [0, 1, 0]  # 1.0 - 0.3 < 0.9, then 0.9 - 0.3 < 0.7


def test_choice_index_offsets_the_seed():
    row = log_probs([0.0] * 50)
    params = SamplingParams(seed=5)

    def draws(index):
        sampler = Sampler(params, index=index)
        return [sampler.choose(row) for _ in range(10)]

    assert draws(0) == draws(0) and draws(0) != draws(1)
    assert draws(1) == [Sampler(SamplingParams(seed=6)).choose(row) for _ in range(1)] + draws(1)[1:]
