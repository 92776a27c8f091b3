"""The pairing the benches share (bench/_pairing.py) on made-up numbers: the order alternates between repeats, and a
median ratio above the 1.02x goal is a miss only when it exceeds how far the A/A control (TRL against TRL) strayed from
1.00; otherwise it is within noise. The tests do not import bench/ (tests/unit/test_layout.py): the module answers one
JSON request per run of its file.
"""

import pytest

from tests.harness import ask_bench

GOAL = 1.02


def ask(request: dict) -> dict:
    return ask_bench("_pairing.py", request)


def test_order_summary_and_the_control_decide_a_miss():
    answer = ask({
        "order": [0, 1, 2],
        "summary": [[1.01, 1.05, 1.03]],
        "verdict": [[1.03, GOAL, [0.95, 1.05]],     # the A/A strayed 0.05 from 1.00: a 0.01 miss is noise
                    [1.03, GOAL, [0.995, 1.005]],   # it strayed 0.005: the 0.01 miss is real
                    [1.03, GOAL, [1.012, 1.018]],   # a bias counts too: the A/A read 1.018 from no difference
                    [1.01, GOAL, [0.995, 1.005]],   # within the goal
                    [1.03, GOAL, None]],            # no control to read it against
    })
    assert answer["order"] == [["trl", "trl_ext"], ["trl_ext", "trl"], ["trl", "trl_ext"]]
    (found,) = answer["summary"]
    assert found == {"ratios": [1.01, 1.05, 1.03], "median": 1.03, "low": 1.01, "high": 1.05}

    noise, real, biased, met, alone = answer["verdict"]
    assert noise["verdict"] == "within noise" and noise["noise"] == pytest.approx(0.05)
    assert noise["miss"] == pytest.approx(0.01)
    assert noise["detail"] == ("1.030x is 0.010 above 1.02x, and the A/A control strayed 0.050 from 1.00 (TRL "
                               "against TRL): not a miss")
    assert real["verdict"] == "miss" and real["noise"] == pytest.approx(0.005)
    assert real["detail"] == "1.030x is 0.010 above 1.02x, more than the A/A control strayed from 1.00 (0.005)"
    assert biased["verdict"] == "within noise" and biased["noise"] == pytest.approx(0.018)
    assert met["verdict"] == "met" and met["miss"] < 0
    assert alone["verdict"] == "miss (no control)" and alone["noise"] is None
