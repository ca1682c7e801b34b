"""Calibration of the cost model from a user's own training logs (``shardplan calibrate`` and
``shardplan check``): the trainers' log formats (:mod:`.logs`, :mod:`.formats`), the steady state of
a run, the few device parameters a fit may move (:mod:`.knobs`), the fit (:mod:`.fit`), the
calibration document (:mod:`.document`), a run compared term by term with its plan (:mod:`.check`)
and logs written in each trainer's format from known numbers (:mod:`.synthetic`)."""
