"""The engine room: requests in, steps, tokens out.

* args.py: ``EngineArgs``, every engine knob once (its flags too; arg_types.py: the flags' parse-time types);
* assembly.py: ``RunnerSpec`` and the one sequence that loads a model and sizes its KV cache into a runner;
* sampling_params.py: ``SamplingParams`` and ``RequestRefused``; validation.py: the one validator's checks;
* engine.py: ``Engine``, one step at a time over the core scheduler and the model runner; observer.py: the
  ``StepObserver`` protocol through which check mode and the trace watch it (ARCH-3);
* model_runner.py: a step's batch to the model's inputs, logits and sampled tokens; logprobs.py: their logprobs;
* graph_runner.py: CUDA-graph decode (and its CPU stand-in);
* cpu_defaults.py: thread count and OpenMP wait policy on a shared machine.

Importing this package imports nothing heavy; torch comes with the modules that need it.
"""
