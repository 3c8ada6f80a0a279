"""The verification room: everything that judges the engine's decisions against the reference.

* reference_port.py: the reference scheduler behind the scheduler port (ARCH-4), a thin adapter;
* shadow.py: check mode, the reference scheduler run beside the engine's, step by step;
* conformance.py: workloads, the normative replay loop and traces (``nanoverify replay``, ``conformance``);
* data/: the 80 conformance samples and the traces the lesson's own code gave for them;
* machines/: the hypothesis state machines (``nanoverify fuzz``), the step and abort contracts they judge with,
  the failure rule they share.
"""
