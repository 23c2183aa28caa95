"""The Lightning ``Trainer`` front end: ``DCPCheckpointIO``, the ``dcp_*`` strategies and the callbacks.

It translates the Trainer's checkpoint dict into the engine's layout (:mod:`lightning_dcp.engine`) and back.
"""
