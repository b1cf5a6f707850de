// libinferd's C++ header (inferd.hpp) against a real daemon: RAII owners, exceptions
// with the wire's codes, outputs read in place. Prints "ok" and the ocr-cls scores.
//
//   test_cxx ENDPOINT
#include <cstdio>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "inferd.hpp"

#define CHECK(cond)                                                                   \
    do {                                                                              \
        if (!(cond)) {                                                                \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            std::exit(1);                                                             \
        }                                                                             \
    } while (0)

int main(int argc, char **argv) {
    CHECK(argc == 2);
    try {
        inferd::Client client(argv[1]);
        CHECK(client.ping() && client.connected());
        std::vector<float> image(1 * 3 * 48 * 192, 0.25f);
        inferd::Call call = client.infer("ocr-cls");
        call.input("x", image, {1, 3, 48, 192}).run();
        CHECK(call.outputs() == 1 && call.code() == INFERD_OK);
        inferd::Tensor y = call.output(0);
        CHECK(y.dtype() == INFERD_FLOAT32 && y.shape().size() == 2 && y.shape()[1] == 2);
        CHECK(y.elements() == 2 && y.bytes().size() == 8);
        std::vector<float> copy = y.copy<float>();
        inferd::View<float> aligned = y.aligned<float>();
        CHECK(aligned.size() == 2 && aligned[0] == copy[0] && y.at<float>(1) == copy[1]);
        std::printf("scores %.9g %.9g\n", copy[0], copy[1]);
        bool threw = false;
        try {
            y.at<double>(0);
        } catch (const inferd::Error &e) {
            threw = e.code() == INFERD_INVALID_ARGUMENT;
        }
        CHECK(threw);

        // moved, not copied: the moved-from owner frees nothing
        inferd::Call moved = std::move(call);
        CHECK(moved.output("save_infer_model/scale_0.tmp_1").elements() == 2);

        inferd::Call labels = client.infer("labels");
        labels.input("x", image, {1, 3, 48, 192}).only_output("topk_labels").run();
        inferd::Tensor names = labels.output("topk_labels");
        CHECK(names.dtype() == INFERD_STRING && names.elements() == 2);
        std::printf("labels [%.*s] [%.*s]\n", (int)names.string(0).size(), names.string(0).data(),
                    (int)names.string(1).size(), names.string(1).data());

        threw = false;
        try {
            client.infer("no-such-model").input("x", image, {1, 3, 48, 192}).run();
        } catch (const inferd::Error &e) {
            threw = e.code() == INFERD_NOT_FOUND &&
                    std::string(e.what()).find("NOT_FOUND: model 'no-such-model'") == 0;
        }
        CHECK(threw);
        threw = false;
        try {
            client.infer("ocr-cls").input("x", image, {1, 3, 48, 100});
        } catch (const inferd::Error &e) {
            threw = e.code() == INFERD_INVALID_ARGUMENT &&
                    std::string(e.what()).find("but its data has") != std::string::npos;
        }
        CHECK(threw);
        // shared memory: the image in a region, the outputs written into it
        inferd::Region region = client.region(1 << 20);
        float *shared = static_cast<float *>(region.data());
        std::copy(image.begin(), image.end(), shared);
        inferd::Call in_shm = client.infer("ocr-cls");
        const std::int64_t shape[4] = {1, 3, 48, 192};
        in_shm.input("x", INFERD_FLOAT32, inferd::View<std::int64_t>(shape, 4), shared,
                     image.size() * sizeof(float))
            .outputs_into(region, 1 << 19, 4096)
            .run();
        CHECK(in_shm.output(0).copy<float>() == copy);
        CHECK(in_shm.output(0).bytes().data() == static_cast<unsigned char *>(region.data()) +
                                                     (1 << 19));
        // a stream (libinferd 0.2): the state stays in the daemon, a restart resets it
        std::int64_t rate = 16000;
        std::vector<float> chunk(512);
        for (std::size_t i = 0; i < chunk.size(); i++)
            chunk[i] = 0.3f * static_cast<float>((i * 7919) % 200) / 200.0f - 0.15f;
        {
            inferd::Stream vad(client, "vad", {{"sr", INFERD_INT64, 0, nullptr, &rate, 8,
                                                nullptr, nullptr}});
            CHECK(!vad.id().empty());
            float first = vad.infer("input", chunk, {1, 512}).output("output").at<float>(0);
            vad.infer("input", chunk, {1, 512});
            vad.reset();
            inferd::Call again = vad.infer("input", chunk, {1, 512});
            CHECK(again.outputs() == 1 && again.output("output").at<float>(0) == first);
            std::printf("stream %.9g\n", first);
            threw = false;
            try {
                vad.infer("input", chunk, {1, 500});
            } catch (const inferd::Error &e) {
                threw = e.code() == INFERD_INVALID_ARGUMENT;
            }
            CHECK(threw);
            vad.close();
            vad.close();  // once is enough
        }  // a stream left open is closed by its destructor
        {
            inferd::Stream open(client, "vad", {{"sr", INFERD_INT64, 0, nullptr, &rate, 8,
                                                 nullptr, nullptr}}, "cxx-left-open");
            open.infer("input", chunk, {1, 512});
        }
        std::string status = client.control(INFERD_OP_STATUS);
        CHECK(status.find("\"ready\":true") != std::string::npos);
        threw = false;
        try {
            inferd::Client nowhere("ipc:///nonexistent/inferd.sock");
        } catch (const inferd::Error &e) {
            threw = e.code() == INFERD_UNAVAILABLE;
        }
        CHECK(threw);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "unexpected: %s\n", e.what());
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
