"""``ai-backend sweep``, one model version timed at each batch size in process: ``cli`` (its
arguments, the model loaded and the run), ``timing`` (the passes per size), ``memory`` (what each
size takes), ``knee`` (where batching stops paying) and ``report`` (the JSON and the table)."""
