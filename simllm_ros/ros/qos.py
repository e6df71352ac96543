"""QoS of the request and answer paths: no request or answer is dropped by DDS while the node is busy.

ROS services default to KEEP_LAST 10. A reader with KEEP_LAST overwrites its oldest unread sample when
an 11th arrives before the executor takes one, so a burst of requests to a busy node (or of answers to a
busy client) silently loses calls (test_burst_while_the_executor_is_held_loses_no_request; docs/interfaces.md).

REQUEST_QOS (KEEP_ALL, reliable) is on the node's Query and Embed services, the action's services and
the ~/requests subscription: a request that DDS delivered waits until the executor takes it, and
admission (queue_limit) then answers it or refuses it as busy. Clients should create their service
clients and response subscriptions with CLIENT_QOS for the same reason on their side.
RESPONSE_QOS (KEEP_LAST 1000, reliable) is on the response topics: deep enough for any burst that
admission lets through, and a subscriber that stops reading never blocks the node (KEEP_ALL would).
"""
from __future__ import annotations

from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

REQUEST_QOS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
CLIENT_QOS = REQUEST_QOS  # the same profile, named for the caller's side
RESPONSE_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1000, reliability=ReliabilityPolicy.RELIABLE)
