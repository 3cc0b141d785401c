"""The bundled lm-evaluation-harness evaluator (issue 41): ``evaluate.lm_eval`` in a recipe.

Two sides. In the training job: ``spec.py`` (the evaluator's argv from the recipe, the scores' names) and
``check.py`` (the start's proof, through ``probe.py`` in the evaluation environment). In the evaluation
environment (``evaluate.python``; needs ``lm-eval[hf,api]``): ``run.py`` (one snapshot scored by the harness's
Python API, offline, on transformers or on the engine that serves it), ``engine.py`` (that engine's weights watched
while the requests run, and requests that score as transformers does), ``probe.py``. ``tasks/`` holds the bundled
task pair on local files. The hook runs the evaluator like any other (``../hook.py``, ``../../runner.py``).
"""
