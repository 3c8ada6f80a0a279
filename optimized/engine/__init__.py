"""The engine room: requests in, steps, tokens out.

* args.py: ``EngineArgs``, every engine knob once (its flags too; arg_types.py: the flags' parse-time types);
* assembly.py: ``RunnerSpec`` and the one sequence that loads a model and sizes its KV cache into a runner;
* sampling_params.py: ``SamplingParams``;
* engine.py: ``Engine``, one step at a time over the core scheduler and the model runner, with check mode;
* model_runner.py: a step's batch to the model's inputs, logits and sampled tokens;
* graph_runner.py: CUDA-graph decode (and its CPU stand-in);
* cpu_defaults.py: thread count and OpenMP wait policy on a shared machine.

Importing this package imports nothing heavy; torch comes with the modules that need it.
"""
