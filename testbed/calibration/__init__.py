"""Fitting a topology's calibration to measured samples, and comparing predictions with measurements (pure).

:mod:`~testbed.calibration.fit` fits one kernel kind at a time,
:mod:`~testbed.calibration.host` what devices sharing a host cost each other,
:mod:`~testbed.calibration.collectives` the links,
:mod:`~testbed.calibration.steps` whole training steps and the controller,
:mod:`~testbed.calibration.calibrated` runs them all (:func:`fit_all`);
:mod:`~testbed.calibration.validation` summarises predicted vs measured.
The measuring itself is :mod:`testbed.runner.measure`'s.
"""
