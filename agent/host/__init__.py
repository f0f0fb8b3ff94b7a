"""The node itself: the one adapter around mount(2) and /proc/self/mountinfo."""
