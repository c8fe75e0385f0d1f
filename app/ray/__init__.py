"""The service on Ray Serve: builder arguments, deployment options, metrics, the config file.

``app.ray_app`` holds the deployment and its builder; these modules hold what it needs.
None of them imports torch, and none starts or joins a Ray cluster at import.
"""
