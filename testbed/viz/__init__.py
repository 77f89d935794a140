"""Pictures: topology drawings and Gantt charts (matplotlib, imported lazily, written atomically)."""
