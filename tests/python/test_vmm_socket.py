"""The client's side of the daemon's descriptor socket (optimd/_vmm.py),
against a real daemon: how torch's expandable-segment chunks reach it.
The CUDA path end to end is test_cuda_e2e.py's
test_expandable_segments_train_as_the_cpu_reference (a GPU)."""
import os
import time
import unittest

from optimd._vmm import DescriptorChannel, descriptor_socket_path
from optimd.testing import Daemon


def memfds(n):
    return [os.memfd_create("optimd-test-%d" % i) for i in range(n)]


class DescriptorSocketTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.path = descriptor_socket_path(cls.daemon.address)

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0

    def setUp(self):
        self.fds = []

    def tearDown(self):
        for fd in self.fds:
            os.close(fd)

    def batch(self, ids):
        fds = memfds(len(ids))
        self.fds += fds
        return list(zip(ids, fds))

    def test_the_path_follows_the_unix_address(self):
        self.assertEqual(descriptor_socket_path("unix:/run/o.sock"),
                         "/run/o.sock.fds")
        self.assertEqual(descriptor_socket_path("unix:///run/o.sock"),
                         "/run/o.sock.fds")
        self.assertIsNone(descriptor_socket_path("localhost:7070"))
        self.assertTrue(os.path.exists(self.path), self.path)

    def test_descriptors_are_kept_while_their_connection_lasts(self):
        ids = [os.urandom(16) for _ in range(70)]  # two messages
        first = DescriptorChannel(self.path)
        first.send(self.batch(ids))
        # Held: the same ids from another connection are refused...
        second = DescriptorChannel(self.path)
        with self.assertRaisesRegex(RuntimeError, "refused"):
            second.send(self.batch(ids[:1]))
        # ...until the first connection ends and they are dropped.
        first.close()
        for _ in range(100):
            try:
                second.send(self.batch(ids[:1]))
                break
            except RuntimeError:
                time.sleep(0.01)  # the daemon has not seen the close yet
        else:
            self.fail("the ids of a closed connection are still held")
        second.close()

    def test_an_id_given_twice_is_refused_and_the_connection_goes_on(self):
        channel = DescriptorChannel(self.path)
        same = os.urandom(16)
        with self.assertRaisesRegex(RuntimeError, "refused"):
            channel.send(self.batch([same, same]))
        channel.send(self.batch([same]))  # nothing of the refused kept
        channel.close()


if __name__ == "__main__":
    unittest.main()
