"""Other ways to serve the same model, for measuring ai-backend side by side with them.

Each rival serves ``POST /predict`` with the body ``ai-backend bench`` sends (JSON, the image as
``image_base64``) and answers the top classes and the batch the image ran in. Every rival decodes
and runs the model exactly as the service does (``classifier.Classifier``: the service's own
decode, its loader, its runtime tuning), so what differs between them is the serving layer only:
how requests reach the model, how they are batched, how many processes and threads do the work.

- ``litserve``: LitServe (Lightning AI), its batching loop in worker processes;
- ``fastapi``: plain FastAPI under uvicorn, one image a forward pass, no batching: what a first
  version of a model server usually is;
- ``ray``: Ray Serve, a deployment with a FastAPI ingress and a ``@serve.batch`` method, its
  replicas actor processes behind Serve's HTTP proxy, on a local Ray this process starts.

``scripts/bench_rivals.sh`` measures them against ``ai-backend serve`` in alternation. Benchmark
references, loopback only, not servers to deploy.
"""
