"""What an alert and the capture it triggered tell people together: the verdict an alert's
notifications carry (``verdicts``) and the event log's lines about captures (``event_lines``).

It sits above both ``alerts`` and ``capture`` (capture imports alerts: a capture is triggered by an
alert's transition), so that neither imports the other back.
"""
