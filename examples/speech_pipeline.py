"""A speech pipeline around simllm_node: each utterance starts a streamed answer, spoken sentence by sentence as
it grows; a new utterance cancels the answer still being spoken (barge-in), as a robot's voice front end does.

    ros2 run ... or:  python examples/speech_pipeline.py --ros-args -r __ns:=/robot1
    topics: ~/utterances (std_msgs/String, in: recognised speech), ~/say (std_msgs/String, out: one sentence
    per message, for a TTS node)

It uses simllm_ros.ros.client, so nothing here blocks the node's executor: feedback arrives on the client's thread
and is published from there.
"""
from __future__ import annotations

import re
import threading

SENTENCE_END = re.compile(r"(.+?[.!?])(\s+|$)", re.S)


class SentenceSplitter:
    """Whole sentences out of a growing text: each is returned once, as soon as it ends."""

    def __init__(self):
        self._said = 0

    def feed(self, text: str) -> list[str]:
        out = []
        for m in SENTENCE_END.finditer(text, self._said):
            if m.end(2) == len(text) and not m.group(2):  # "...end." with nothing after: it may still grow
                break
            out.append(m.group(1).strip())
            self._said = m.end()
        return out

    def rest(self, text: str) -> str:
        return text[self._said:].strip()


class SpeechPipeline:
    """The node's logic: one answer at a time; a new utterance cancels the previous one."""

    def __init__(self, node, client, context: str = "", max_new_tokens: int = 96):
        from std_msgs.msg import String

        self._String = String
        self._client, self._context, self._max_new = client, context, max_new_tokens
        self._pub = node.create_publisher(String, "~/say", 10)
        node.create_subscription(String, "~/utterances", self._on_utterance, 10)
        self._lock = threading.Lock()
        self._run = None
        self.runs = 0

    def _say(self, sentence: str) -> None:
        if sentence:
            self._pub.publish(self._String(data=sentence))

    def _on_utterance(self, msg) -> None:
        splitter = SentenceSplitter()
        with self._lock:
            if self._run is not None:
                self._run.cancel()  # barge-in: the answer being spoken stops within one decode pass
            current = []

            def feedback(text: str) -> None:
                if current and current[0] is self._run:  # a cancelled run's late feedback is not spoken
                    for s in splitter.feed(text):
                        self._say(s)

            self._run = self._client.generate(msg.data, context=self._context, max_new_tokens=self._max_new,
                                              on_feedback=feedback)
            current.append(self._run)
            self.runs += 1
            run = self._run

        def finished(f) -> None:
            if f.exception() is None and f.result().success and run is self._run:
                self._say(splitter.rest(f.result().answer))  # the last words, whatever the feedback held back

        run.result.add_done_callback(finished)


def main() -> None:
    import rclpy

    from simllm_ros.ros.client import SimllmClient

    rclpy.init()
    node = rclpy.create_node("speech_pipeline")
    client = SimllmClient(node.declare_parameter("target", "/simllm_node").value)
    SpeechPipeline(node, client, context=node.declare_parameter("context", "").value)
    try:
        rclpy.spin(node)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
