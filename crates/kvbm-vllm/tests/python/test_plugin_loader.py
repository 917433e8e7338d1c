"""The kvbm plugin as vLLM loads it: vLLM's own loader (``vllm.plugins``, reading
``VLLM_PLUGINS`` through ``vllm.envs``) finds the installed wheel's ``vllm.general_plugins``
entry point named ``kvbm`` and runs it; the README's allow-list form (``VLLM_PLUGINS=kvbm``)
loads it, a list without it does not, and then the README's ``module_path`` forms still work.

Each case runs in a fresh interpreter (vLLM loads plugins once per process), with vLLM's real
loader and environment module over the harness's extraction (or a real vLLM when installed).
"""

import json
import os
import subprocess
import sys

import pytest

from kvbm_vllm.replay import ensure_vllm

HOW = ensure_vllm()
REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))

PRELUDE = """
import importlib.util, json, os, sys
src = {src!r}
if src:
    spec = importlib.util.spec_from_file_location("_kvbm_upstream_stubs", {stubs!r})
    stubs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stubs)
    stubs.install(src, real=("vllm.envs",))
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
for f in loaded.values():
    f()
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
specs = sorted(n for n in ("KvbmOffloadingSpec", "KvbmDiskDirectSpec")
               if n in OffloadingSpecFactory._registry)
tiers = sorted(n for n in ("kvbm_disk", "kvbm_fleet", "kvbm_object")
               if n in SecondaryTierFactory._registry)
# The README's plug-in-free forms: the tier class by module path, short name or class name.
cls = [SecondaryTierFactory.get_tier_class({{"type": t, "module_path": "kvbm_vllm.tiers"}}).__name__
       for t in ("kvbm_disk", "KvbmDiskTier")]
print(json.dumps({{"loaded": sorted(loaded), "specs": specs, "tiers": tiers, "cls": cls}}))
"""


def run(plugins):
    src = None if HOW == "installed" else HOW.removeprefix("stubs: ")
    code = PRELUDE.format(src=src, stubs=os.path.join(
        REPO, "crates", "kvbm-vllm", "tests", "upstream", "stubs.py"))
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_loads_the_kvbm_plugin_by_its_entry_point():
    r = run(None)
    assert "kvbm" in r["loaded"]
    assert r["specs"] == ["KvbmDiskDirectSpec", "KvbmOffloadingSpec"]
    assert r["tiers"] == ["kvbm_disk", "kvbm_fleet", "kvbm_object"]


def test_an_allow_list_naming_kvbm_loads_it():
    r = run("kvbm")
    assert r["loaded"] == ["kvbm"]
    assert r["tiers"] == ["kvbm_disk", "kvbm_fleet", "kvbm_object"]


@pytest.mark.parametrize("plugins", ["someone_else", ""])
def test_an_allow_list_without_kvbm_leaves_it_out_and_module_paths_still_work(plugins):
    r = run(plugins)
    assert "kvbm" not in r["loaded"]
    assert r["specs"] == [] and r["tiers"] == []
    assert r["cls"] == ["KvbmDiskTier", "KvbmDiskTier"]
