"""The demo job: a tiny corpus, a tiny model, a checkpoint, a resume in a new process, and a report."""
