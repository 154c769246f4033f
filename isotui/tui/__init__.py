"""The Textual app. Imports no torch: the first frame is drawn before any model code loads."""
