"""The installed torchtitan's front end (torchtitan_0_2/front_end.py or torchtitan_0_3/
front_end.py, which give the same names: activate, parse_job, run_config, build_trainer), for
the entry points that run under either (titan_hybrid.launch, titan_hybrid.train)."""

from __future__ import annotations

from titan_hybrid.compat import TORCHTITAN_RELEASE

if TORCHTITAN_RELEASE == (0, 2):
    from titan_hybrid.adapters.torchtitan_0_2 import front_end
else:
    from titan_hybrid.adapters.torchtitan_0_3 import front_end

__all__ = ["front_end"]
