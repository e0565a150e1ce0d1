"""`dustin serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the continuous-batching `EngineCore`.

- async_engine.py: `AsyncEngineCore`, the engine thread and per-request asyncio streams;
- protocol.py: request / response bodies (OpenAI's shapes);
- detokenize.py: incremental detokenization and stop strings;
- app.py: `create_app`, the routes, errors and metrics;
- cli.py: the `dustin serve` command.
"""
