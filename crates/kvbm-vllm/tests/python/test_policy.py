"""A Python tier's offload policy under kvbm's tiering manager: its ``on_new_request`` answer's
``policy`` is vLLM's ``OffloadPolicy`` member, recognised by identity (the members the manager
was built with), and the manager's own answer is ``REQUEST_LEVEL`` when a tier asked for it, as
vLLM's is. A policy that is neither member nor has one's value is an error naming it, never a
silent chunk-level request. Needs what ``test_replay.py`` needs.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_stats  # noqa: E402  (its manager over a Python tier)

env = test_stats.env


def _answer(env, policy, req_id="r"):
    B, manager = env
    m = manager()
    m.secondary_tiers[0].policy = policy
    try:
        return m.on_new_request(B.ReqContext(req_id=req_id)).policy
    finally:
        m.shutdown()


def test_a_tiers_policy_member_is_the_managers_answer(env):
    B, _ = env
    assert _answer(env, B.OffloadPolicy.REQUEST_LEVEL) is B.OffloadPolicy.REQUEST_LEVEL
    assert _answer(env, B.OffloadPolicy.CHUNK_LEVEL) is B.OffloadPolicy.CHUNK_LEVEL
    assert _answer(env, None) is B.OffloadPolicy.CHUNK_LEVEL


def test_a_policy_of_unknown_value_is_an_error_naming_it(env):
    class Odd:
        value = "per_layer"

    with pytest.raises(ValueError, match="per_layer"):
        _answer(env, Odd())
