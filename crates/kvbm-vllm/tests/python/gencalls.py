"""Call sequences for the replay tests (the JSONL format of ``kvbm_vllm.replay``).

A scheduler-like workload, seeded and deterministic: requests over shared "documents"
(Zipf-weighted prefixes) plus unique suffixes, each living three steps -- lookup; lookup again,
load the HIT run, store everything unless deferred, sometimes touch; complete the load and the
store (sometimes failed), finish -- with ``on_schedule_end`` and ``take_events`` every step and
a drained ``reset_cache`` now and then. On top of that, what a recorded sequence may also hold
and the replays must treat alike: explicit ``on_new_request``, explicit keys on
``prepare_load`` / ``complete_load`` / ``complete_store`` (some break the manager's contract
and are counted as errors), string keys (non-ASCII, escapes), integer request ids, a request
id reused after it finished, and an unknown method.

    python3 gencalls.py --seed 5 [--steps 120] > calls.jsonl
"""

import argparse
import json
import random


def generate(seed, steps=120, docs=24, doc_len=20, fail=0.05, reset=0.02, extras=True):
    """The calls (a list of dicts) for `seed`."""
    rnd = random.Random(seed)
    doc_keys = [[1_000_000 * (d + 1) + i for i in range(doc_len)] for d in range(docs)]
    if extras:  # a few documents keyed by strings, as a recording of raw hashes could be
        doc_keys[1] = [f"doc-é-{i}" for i in range(doc_len)]
        doc_keys[3] = [f'q"\\\t{i}' for i in range(doc_len)]
    weights = [1.0 / (r + 1) ** 0.9 for r in range(docs)]
    out = []
    emit = out.append
    nxt, uniq = 0, 10**9
    active = []
    drain = 0
    finished = []
    for _step in range(steps):
        if drain == 0 and rnd.random() < reset:
            drain = 3
        for _ in range(0 if drain else rnd.randint(1, 5)):
            d = rnd.choices(range(docs), weights)[0]
            n = rnd.randint(1, doc_len)
            suffix = [uniq + i for i in range(rnd.randint(0, 5))]
            uniq += len(suffix)
            req = f"r{nxt}"
            if extras and finished and rnd.random() < 0.05:
                req = finished.pop(rnd.randrange(len(finished)))  # an id used again
            elif extras and rnd.random() < 0.05:
                req = nxt  # an integer id (the replay takes str() of it)
            active.append({"req": req, "keys": doc_keys[d][:n] + suffix, "stage": 0})
            if extras and rnd.random() < 0.3:
                emit({"method": "on_new_request", "req": req})
            nxt += 1
        still = []
        for r in active:
            req, keys, st = r["req"], r["keys"], r["stage"]
            if st == 0:
                emit({"method": "lookup", "req": req, "keys": keys})
                r["stage"] = 1
            elif st == 1:
                emit({"method": "lookup", "req": req, "keys": keys})
                x = rnd.random() if extras else 1.0
                if x < 0.05:  # explicit keys: the first few, hit or not (a miss is an error)
                    r["load"] = keys[: rnd.randint(1, len(keys))]
                    emit({"method": "prepare_load", "req": req, "keys": r["load"],
                          "unless_deferred": True})
                else:
                    emit({"method": "prepare_load", "req": req})
                emit({"method": "prepare_store", "req": req, "keys": keys,
                      "unless_deferred": True})
                if rnd.random() < 0.2:
                    emit({"method": "touch", "req": req, "keys": keys[: rnd.randint(1, len(keys))]})
                r["stage"] = 2
            elif st == 2:
                if "load" in r and rnd.random() < 0.5:
                    emit({"method": "complete_load", "req": req, "keys": r["load"]})
                else:
                    emit({"method": "complete_load", "req": req})
                ok = rnd.random() >= fail
                x = rnd.random() if extras else 1.0
                if x < 0.05:  # explicit keys: all of them (those not prepared are an error)
                    emit({"method": "complete_store", "req": req, "keys": keys, "success": ok})
                elif x < 0.08:
                    emit({"method": "complete_store", "req": req, "keys": [], "success": ok})
                else:
                    emit({"method": "complete_store", "req": req, "success": ok})
                emit({"method": "on_request_finished", "req": req})
                finished.append(req)
                r["stage"] = 3
            if r["stage"] < 3:
                still.append(r)
        active = still
        emit({"method": "on_schedule_end"})
        if extras and rnd.random() < 0.01:
            emit({"method": "flush_everything", "req": "r0"})  # unknown: an error line
        emit({"method": "take_events"})
        if drain:
            drain -= 1
            if drain == 0 and not active:
                emit({"method": "reset_cache"})
    return out


def dumps(calls):
    """JSONL text of `calls`."""
    return "".join(json.dumps(c) + "\n" for c in calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--plain", action="store_true", help="the scheduler workload only")
    a = ap.parse_args()
    print(dumps(generate(a.seed, a.steps, extras=not a.plain)), end="")


if __name__ == "__main__":
    main()
