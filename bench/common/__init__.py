"""Helpers of the bench scripts: progress lines, markdown reports and tables, copy bandwidth,
random params on the device (`helpers`); GPU kernel events of a profiler trace (`device_time`)."""
