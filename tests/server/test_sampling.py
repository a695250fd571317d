import torch

from server.sampling import Sampler, SamplingParams, StopChecker


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
